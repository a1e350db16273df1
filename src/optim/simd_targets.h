#pragma once
// The target attributes of amp's hand-written vector loops. The library is built for the x86-64 baseline; a loop
// with one of these runs only where codec_loops_at (cpu_state_codec.h) says the CPU has its instructions.

#if defined(__GNUC__) && defined(__x86_64__)
#define AMP_HAVE_SIMD_LOOPS 1
#define AMP_AVX2 __attribute__((target("avx2,fma")))
#define AMP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define AMP_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma")))
#endif
