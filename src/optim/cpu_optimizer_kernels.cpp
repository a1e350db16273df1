#include "optim/cpu_optimizer_kernels.h"

#include <algorithm>
#include <cmath>

#include "optim/bf16_rounding_simd.h"
#include "optim/codes_avx2.h"
#include "optim/codes_avx512.h"

// NOTE [Fused step arithmetic]
// Per element, the loops below do what LibTorch's optimizers do with one ATen op after another, in the same
// order and with the same scalars rounded to float (ATen's opmath for fp32): `add(x, alpha)` and addcmul's
// last product are fused multiply-adds (as ATen's vectorized kernels compute them), addcdiv is
// self + (value * a) / b, a division by a scalar is a true division. The file is built with
// -ffp-contract=off, so no other product is fused and every vector clone (NOTE [Vectorized clones] in
// cpu_kernels.h) gives the same bits. SGD therefore equals LibTorch's step bit for bit, and Adam's moments
// do too; Adam's parameter differs by an ulp here and there because ATen's vectorized sqrt is not the
// correctly rounded one this loop uses (tests/fused_optimizers_test.cpp). Nothing depends on how many
// tensors are stepped together or on whether the O2 model copy is written. With a loss scale (inv != 1) the
// unscaled gradient is stored back, as ATen's fused kernels do, so .grad() reads the same after any route.

namespace amp::detail::cpu {
namespace {

// The model copy is written chunk by chunk right after the chunk's update, while it is still in cache.
constexpr int64_t kChunk = 4096;

template <class Update>
void chunked(int64_t n, float* param, ModelCopy copy, Update update) {
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t end = std::min(n, begin + kChunk);
    update(begin, end);
    if (copy.data != nullptr) {
      const int64_t bytes = copy.dtype == Dtype::Float ? 4 : 2;
      convert(param + begin, copy.dtype, static_cast<char*>(copy.data) + begin * bytes, end - begin);
    }
  }
}

struct AdamFloats {
  float inv, decay, wd, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

// The body every Adam variant shares; inlined into each clone below so the branches on L2 and AMSGRAD are
// resolved at compile time and each loop vectorizes.
template <bool L2, bool AMSGRAD, bool STORE_GRAD>
__attribute__((always_inline)) inline void adam_body(float* __restrict p, float* __restrict g_io,
                                                     float* __restrict m, float* __restrict v,
                                                     float* __restrict vmax, int64_t begin, int64_t end,
                                                     const AdamFloats& f) {
  for (int64_t i = begin; i < end; ++i) {
    const float param = p[i] * f.decay;                        // AdamW's p.mul_(1 - lr * wd); decay is 1 otherwise
    float g = g_io[i] * f.inv;
    if constexpr (STORE_GRAD) g_io[i] = g;
    if constexpr (L2) g = std::fma(param, f.wd, g);            // Adam's grad.add(p, wd)
    const float mi = std::fma(g, f.one_minus_beta1, m[i] * f.beta1);
    const float vi = std::fma(f.one_minus_beta2 * g, g, v[i] * f.beta2);
    m[i] = mi;
    v[i] = vi;
    float second = vi;
    if constexpr (AMSGRAD) {
      const float mx = vmax[i];
      second = mx >= vi ? mx : vi;                             // torch::max_out, NaN-propagating
      vmax[i] = second;
    }
    const float denom = std::sqrt(second) / f.bc2_sqrt + f.eps;
    p[i] = param + (f.neg_step_size * mi) / denom;
  }
}

// Each clone holds both loops, with and without the gradient store, so neither branches per element.
#define AMP_ADAM_CLONE(name, L2, AMSGRAD)                                                                   \
  AMP_VECTOR_CLONES void name(float* p, float* g, float* m, float* v, float* vmax, int64_t b, int64_t e, \
                              const AdamFloats& f, bool store_grad) {                                     \
    if (store_grad) adam_body<L2, AMSGRAD, true>(p, g, m, v, vmax, b, e, f);                               \
    else adam_body<L2, AMSGRAD, false>(p, g, m, v, vmax, b, e, f);                                         \
  }
AMP_ADAM_CLONE(adam_plain, false, false)
AMP_ADAM_CLONE(adam_l2, true, false)
AMP_ADAM_CLONE(adam_amsgrad, false, true)
AMP_ADAM_CLONE(adam_l2_amsgrad, true, true)
#undef AMP_ADAM_CLONE

// Adam with the moments torchao computes: exp_avg.lerp(g, 1 - beta1), exp_avg_sq.lerp(g * g, 1 - beta2), where ATen's
// vectorized lerp is fma(w, end - start, start) for |w| < 0.5 and fma(w - 1, end - start, end) otherwise; Adam's L2
// decay is torchao's grad + weight_decay * p. The rest is adam_body's.
struct LerpWeights {
  float coeff1, coeff2;  // w or w - 1
  bool small1, small2;   // |w| < 0.5: the base is the moment, else the new value
};

template <bool L2, bool AMSGRAD, bool STORE_GRAD>
__attribute__((always_inline)) inline void adam_lerp_body(float* __restrict p, float* __restrict g_io,
                                                          float* __restrict m, float* __restrict v,
                                                          float* __restrict vmax, int64_t n, const AdamFloats& f,
                                                          const LerpWeights& w) {
  for (int64_t i = 0; i < n; ++i) {
    const float param = p[i] * f.decay;
    float g = g_io[i] * f.inv;
    if constexpr (STORE_GRAD) g_io[i] = g;
    if constexpr (L2) g = g + f.wd * param;
    const float square = g * g;
    const float mi = std::fma(w.coeff1, g - m[i], w.small1 ? m[i] : g);
    const float vi = std::fma(w.coeff2, square - v[i], w.small2 ? v[i] : square);
    m[i] = mi;
    v[i] = vi;
    float second = vi;
    if constexpr (AMSGRAD) {
      const float mx = vmax[i];
      second = mx >= vi ? mx : vi;
      vmax[i] = second;
    }
    const float denom = std::sqrt(second) / f.bc2_sqrt + f.eps;
    p[i] = param + (f.neg_step_size * mi) / denom;
  }
}

#define AMP_ADAM_LERP_CLONE(name, L2, AMSGRAD)                                                                    \
  AMP_VECTOR_CLONES void name(float* p, float* g, float* m, float* v, float* vmax, int64_t n, const AdamFloats& f, \
                              const LerpWeights& w, bool store_grad) {                                           \
    if (store_grad) adam_lerp_body<L2, AMSGRAD, true>(p, g, m, v, vmax, n, f, w);                                \
    else adam_lerp_body<L2, AMSGRAD, false>(p, g, m, v, vmax, n, f, w);                                          \
  }
AMP_ADAM_LERP_CLONE(adam_lerp_plain, false, false)
AMP_ADAM_LERP_CLONE(adam_lerp_l2, true, false)
AMP_ADAM_LERP_CLONE(adam_lerp_amsgrad, false, true)
AMP_ADAM_LERP_CLONE(adam_lerp_l2_amsgrad, true, true)
#undef AMP_ADAM_LERP_CLONE

template <bool STORE_GRAD>
__attribute__((always_inline)) inline void sgd_body(float* __restrict p, float* __restrict g_io, float* __restrict buf,
                                                    int64_t begin, int64_t end, float inv, float wd, float momentum,
                                                    float one_minus_dampening, float neg_lr, bool use_momentum,
                                                    bool nesterov, bool first_step) {
  for (int64_t i = begin; i < end; ++i) {
    const float param = p[i];
    float d = g_io[i] * inv;
    if constexpr (STORE_GRAD) g_io[i] = d;
    if (wd != 0.0f) d = std::fma(param, wd, d);                   // d_p.add(p, wd)
    if (use_momentum) {
      const float b = first_step ? d : std::fma(d, one_minus_dampening, buf[i] * momentum);
      buf[i] = b;
      d = nesterov ? std::fma(b, momentum, d) : b;                // d_p.add(buf, momentum) or buf
    }
    p[i] = std::fma(d, neg_lr, param);                            // p.add_(d_p, -lr)
  }
}

AMP_VECTOR_CLONES void sgd_range(float* p, float* g, float* buf, int64_t begin, int64_t end, float inv, float wd,
                                 float momentum, float one_minus_dampening, float neg_lr, bool use_momentum,
                                 bool nesterov, bool first_step, bool store_grad) {
  if (store_grad) {
    sgd_body<true>(p, g, buf, begin, end, inv, wd, momentum, one_minus_dampening, neg_lr, use_momentum, nesterov, first_step);
  } else {
    sgd_body<false>(p, g, buf, begin, end, inv, wd, momentum, one_minus_dampening, neg_lr, use_momentum, nesterov, first_step);
  }
}

// Apex's LAMBStage1Functor, per element in fp32 and in its order (nvcc's --use_fast_math may fuse or approximate
// some of these on a GPU; here every operation is rounded as written).
template <bool ADAM_W>
__attribute__((always_inline)) inline void lamb_stage1_body(const float* __restrict p, const float* __restrict g,
                                                            float* __restrict m, float* __restrict v,
                                                            float* __restrict u, int64_t begin, int64_t end,
                                                            const LambScalars& s) {
  const float one_minus_beta2 = 1.0f - s.beta2;
  for (int64_t i = begin; i < end; ++i) {
    float scaled = g[i] / s.clip;
    if constexpr (!ADAM_W) scaled = scaled + s.weight_decay * p[i];
    const float mi = m[i] * s.beta1 + s.beta3 * scaled;
    const float vi = v[i] * s.beta2 + one_minus_beta2 * scaled * scaled;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi / s.bias_correction2) + s.eps;
    float update = (mi / s.bias_correction1) / denom;
    if constexpr (ADAM_W) update = update + s.weight_decay * p[i];
    u[i] = update;
  }
}

AMP_VECTOR_CLONES void lamb_stage1_adam_w(const float* p, const float* g, float* m, float* v, float* u, int64_t b,
                                          int64_t e, const LambScalars& s) {
  lamb_stage1_body<true>(p, g, m, v, u, b, e, s);
}
AMP_VECTOR_CLONES void lamb_stage1_l2(const float* p, const float* g, float* m, float* v, float* u, int64_t b,
                                      int64_t e, const LambScalars& s) {
  lamb_stage1_body<false>(p, g, m, v, u, b, e, s);
}

AMP_VECTOR_CLONES void lamb_stage2_range(float* __restrict p, const float* __restrict u, int64_t begin, int64_t end,
                                         float ratio) {
  for (int64_t i = begin; i < end; ++i) p[i] = p[i] - ratio * u[i];
}

}  // namespace

void lamb_stage1(const float* param, const float* grad, float* exp_avg, float* exp_avg_sq, float* update, int64_t n,
                 const LambScalars& s) {
  (s.adam_w_mode ? lamb_stage1_adam_w : lamb_stage1_l2)(param, grad, exp_avg, exp_avg_sq, update, 0, n, s);
}

void lamb_stage2(float* param, const float* update, int64_t n, float ratio, ModelCopy copy) {
  chunked(n, param, copy, [&](int64_t begin, int64_t end) { lamb_stage2_range(param, update, begin, end, ratio); });
}

namespace {

// The scalars as LibTorch's Adam computes them (in double), then rounded to float as ATen does.
AdamFloats adam_floats(const AdamScalars& s) {
  const double bc1 = 1 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1 - std::pow(s.beta2, static_cast<double>(s.step));
  const auto decay = static_cast<float>(s.decoupled_weight_decay && s.weight_decay != 0 ? 1 - s.lr * s.weight_decay : 1.0);
  return AdamFloats{s.inv_scale, decay, static_cast<float>(s.weight_decay), static_cast<float>(s.beta1),
                    static_cast<float>(1 - s.beta1), static_cast<float>(s.beta2), static_cast<float>(1 - s.beta2),
                    static_cast<float>(std::sqrt(bc2)), static_cast<float>(s.eps), static_cast<float>(-(s.lr / bc1))};
}

// Runs `update(offset, n, m, v, x)` on each chunk of [begin, end) with the chunk's moments decoded into fp32 scratch
// (x: the third moment, when `third`), then encodes them back.
template <class Update>
void stored_chunks(const StateView& m, const StateView& v, const StateView* third, int64_t begin, int64_t end,
                   Update update) {
  float ms[kStoredChunk], vs[kStoredChunk], xs[kStoredChunk];
  for (int64_t c = begin; c < end; c += kStoredChunk) {
    const int64_t n = std::min(kStoredChunk, end - c);
    decode(m, c, n, ms);
    decode(v, c, n, vs);
    if (third) decode(*third, c, n, xs);
    update(c, n, ms, vs, xs);
    encode(m, c, n, ms);
    encode(v, c, n, vs);
    if (third) encode(*third, c, n, xs);
  }
}

#ifdef AMP_HAVE_AVX512_CODES
// adam_lerp_body's scalars in registers, and its arithmetic on 16 values: the one-pass loops below share it.
struct LerpRegisters {
  __m512 decay, inv, wd, coeff1, coeff2, bc2_sqrt, eps, neg_step;
  __mmask16 base1, base2;  // lanes whose lerp base is the moment
  AMP_AVX512 LerpRegisters(const AdamFloats& f, const LerpWeights& w)
      : decay(_mm512_set1_ps(f.decay)), inv(_mm512_set1_ps(f.inv)), wd(_mm512_set1_ps(f.wd)),
        coeff1(_mm512_set1_ps(w.coeff1)), coeff2(_mm512_set1_ps(w.coeff2)), bc2_sqrt(_mm512_set1_ps(f.bc2_sqrt)),
        eps(_mm512_set1_ps(f.eps)), neg_step(_mm512_set1_ps(f.neg_step_size)), base1(w.small1 ? 0xffff : 0),
        base2(w.small2 ? 0xffff : 0) {}
};

/// Updates p[0, 16) (and stores the unscaled g[0, 16) where STORE_GRAD) from the moments mo, vo; the new moments in
/// *mi, *vi.
template <bool L2, bool STORE_GRAD>
AMP_AVX512 inline void adam_lerp16(float* p, float* g, __m512 mo, __m512 vo, const LerpRegisters& r, __m512* mi,
                                   __m512* vi) {
  const __m512 param = _mm512_mul_ps(_mm512_loadu_ps(p), r.decay);
  __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g), r.inv);
  if constexpr (STORE_GRAD) _mm512_storeu_ps(g, gi);
  if constexpr (L2) gi = _mm512_add_ps(gi, _mm512_mul_ps(r.wd, param));
  const __m512 square = _mm512_mul_ps(gi, gi);
  *mi = _mm512_fmadd_ps(r.coeff1, _mm512_sub_ps(gi, mo), _mm512_mask_blend_ps(r.base1, gi, mo));
  *vi = _mm512_fmadd_ps(r.coeff2, _mm512_sub_ps(square, vo), _mm512_mask_blend_ps(r.base2, square, vo));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(*vi), r.bc2_sqrt), r.eps);
  _mm512_storeu_ps(p, _mm512_add_ps(param, _mm512_div_ps(_mm512_mul_ps(r.neg_step, *mi), denom)));
}

// NOTE [The 8-bit step in one pass]
// Adam's division and square root bound its arithmetic (fp32 moments: about 2 cycles a value on a Xeon for them
// alone), and the out-of-order core runs other work beside them only when it is in the same loop. So with both
// moments 8-bit, one loop per block of 256 decodes the block's codes, updates it (adam_lerp_body's arithmetic) and
// encodes the block before it, whose scale needed all of it first: the codec's work runs in the divider's shadow
// instead of in passes of its own. Every operation is the portable loops' (adam_lerp_body, the codec's), so the
// parameters, codes and scales are theirs bit for bit (StateFormatCodecTest.EightBitAdamStepOnEveryLoop). Where the
// codec decodes by permutes, a block's codes are decoded whole before its loop (NOTE [Decoding by permutes]).
struct PendingBlock {
  float* m = nullptr;  // the block's updated moments (scratch), encoded at element `at`
  float* v = nullptr;
  int64_t at = -1;
};

AMP_AVX512 inline void encode_scratch(const StateView& view, int64_t at, const float* values, __m512i absmax) {
  if (!avx512::encode_block(values, absmax, static_cast<uint8_t*>(view.data) + at, view.scales + at / kCodeBlock,
                            view.buckets, view.lines)) {
    encode(view, at, kCodeBlock, values);  // inf or NaN: the codec's search
  }
}

// LINES: both moments' maps have lines (NOTE [Codes by lines] in cpu_state_codec.cpp), m's signed and v's not.
template <bool L2, bool STORE_GRAD, bool LINES>
AMP_AVX512 void adam_lerp_codes(float* p, float* g, const StateView& m, const StateView& v, int64_t begin,
                                int64_t end, const AdamFloats& f, const LerpWeights& w, ModelCopy copy) {
  alignas(64) float scratch[2][2][kCodeBlock];  // [block parity][moment]
  alignas(64) float decoded[2][kCodeBlock];     // the block's moments before the step, where decoded by permutes
  const bool by_permutes = m.map_bytes != nullptr && v.map_bytes != nullptr && codec_loops_at(CodecLoops::kAvx512Vbmi);
  const LerpRegisters lerp(f, w);
  const auto* m_codes = static_cast<const uint8_t*>(m.data);
  const auto* v_codes = static_cast<const uint8_t*>(v.data);
  // Unused without LINES; the lines of a map that has none would be empty.
  static const CodeLines kNoLines{};
  const avx512::LineRegisters m_lines(LINES ? *m.lines : kNoLines), v_lines(LINES ? *v.lines : kNoLines);
  PendingBlock pending;
  __m512i pending_m_max = _mm512_setzero_si512(), pending_v_max = _mm512_setzero_si512();
  // The pending block's encoding, 16 values at a time inside the next block's loop (its scale is known by then).
  __m512 pm_s = _mm512_setzero_ps(), pm_r = pm_s, pv_s = pm_s, pv_r = pm_s;
  float pm = 0, pv = 0;  // the pending block's scales
  bool pm_fast = false, pv_fast = false, pm_recip = false, pv_recip = false;
  for (int64_t c = begin; c < end; c += kCodeBlock) {
    float* m_out = scratch[(c / kCodeBlock) & 1][0];
    float* v_out = scratch[(c / kCodeBlock) & 1][1];
    const __m512 m_scale = _mm512_set1_ps(m.scales[c / kCodeBlock]), v_scale = _mm512_set1_ps(v.scales[c / kCodeBlock]);
    __m512i m_max = _mm512_setzero_si512(), v_max = _mm512_setzero_si512();
    if (by_permutes) {
      avx512::decode_block_by_permutes(m_codes + c, m.scales[c / kCodeBlock], m.map_bytes, decoded[0]);
      avx512::decode_block_by_permutes(v_codes + c, v.scales[c / kCodeBlock], v.map_bytes, decoded[1]);
    }
    for (int64_t j = 0; j < kCodeBlock; j += 16) {
      const int64_t i = c + j;
      const __m512 mo = by_permutes ? _mm512_load_ps(decoded[0] + j) : avx512::decode16(m_codes + i, m_scale, m.map);
      const __m512 vo = by_permutes ? _mm512_load_ps(decoded[1] + j) : avx512::decode16(v_codes + i, v_scale, v.map);
      __m512 mi, vi;
      adam_lerp16<L2, STORE_GRAD>(p + i, g + i, mo, vo, lerp, &mi, &vi);
      _mm512_store_ps(m_out + j, mi);
      _mm512_store_ps(v_out + j, vi);
      m_max = avx512::absmax_bits(m_max, mi);
      v_max = avx512::absmax_bits(v_max, vi);
      if (pm_fast) {
        uint8_t* to = static_cast<uint8_t*>(m.data) + pending.at + j;
        if constexpr (LINES) {
          avx512::codes16_by_lines<true>(pending.m + j, pm_s, pm_r, pm_recip, pm, m_lines, m.buckets, to);
        } else {
          avx512::codes16(avx512::divide16(_mm512_load_ps(pending.m + j), pm_s, pm_r, pm_recip), m.buckets, to);
        }
      }
      if (pv_fast) {
        uint8_t* to = static_cast<uint8_t*>(v.data) + pending.at + j;
        if constexpr (LINES) {
          avx512::codes16_by_lines<false>(pending.v + j, pv_s, pv_r, pv_recip, pv, v_lines, v.buckets, to);
        } else {
          avx512::codes16(avx512::divide16(_mm512_load_ps(pending.v + j), pv_s, pv_r, pv_recip), v.buckets, to);
        }
      }
    }
    if (pending.at >= 0) {  // a moment with inf or NaN: the codec's own loop, after
      if (!pm_fast) encode_scratch(m, pending.at, pending.m, pending_m_max);
      if (!pv_fast) encode_scratch(v, pending.at, pending.v, pending_v_max);
    }
    if (copy.data != nullptr) {
      const int64_t bytes = copy.dtype == Dtype::Float ? 4 : 2;
      convert(p + c, copy.dtype, static_cast<char*>(copy.data) + c * bytes, kCodeBlock);
    }
    // This block becomes the pending one; its scales are written now, as nothing reads them again.
    pending = PendingBlock{m_out, v_out, c};
    pending_m_max = m_max, pending_v_max = v_max;
    const float sm = avx512::block_scale(m_max), sv = avx512::block_scale(v_max);
    pm_fast = std::isfinite(sm), pv_fast = std::isfinite(sv);
    pm = sm, pv = sv;
    if (pm_fast) {
      m.scales[c / kCodeBlock] = sm;
      pm_s = _mm512_set1_ps(sm), pm_r = _mm512_set1_ps(1.0f / sm), pm_recip = divides_by_reciprocal(sm);
    }
    if (pv_fast) {
      v.scales[c / kCodeBlock] = sv;
      pv_s = _mm512_set1_ps(sv), pv_r = _mm512_set1_ps(1.0f / sv), pv_recip = divides_by_reciprocal(sv);
    }
  }
  if (pending.at >= 0) {
    encode_scratch(m, pending.at, pending.m, pending_m_max);
    encode_scratch(v, pending.at, pending.v, pending_v_max);
  }
}

// NOTE [The bf16 step in one pass]
// bf16 moments with stochastic rounding cost their draws and roundings (0.155 ns a value each on Zen 5). In passes of
// their own (decode a chunk, update it, encode it) the step took 1.9x fp32's time; in the same loop as Adam's
// divisions they run in the divider's shadow (NOTE [The 8-bit step in one pass]) and the step takes less than fp32's
// (it moves 20 bytes a value to fp32's 28). Each moment's draws are its own stream's, value g = first + i taking word
// g & 3 of draw g >> 2 (stochastic_rounding.h; MomentWords in bf16_rounding_simd.h: where first is not a multiple of
// 4, a vector's words start 1-3 words into its draws). The arithmetic is adam_lerp_body's and the rounding
// round_stochastically's, so parameters and moments are the chunked path's bit for bit, with AVX-512 (32 values a
// step) and AVX2 (16) alike (StateFormatCodecTest.Bf16AdamStepOnEveryLoop).

/// 16 bfloat16 values as floats (exact).
AMP_AVX512 inline __m512 widen_bf16(const uint16_t* bits) {
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

// [begin, end) a multiple of 32 values long.
template <bool L2, bool STORE_GRAD>
AMP_AVX512 void adam_lerp_bf16(float* p, float* g, const StateView& m, const StateView& v, int64_t begin, int64_t end,
                               const AdamFloats& f, const LerpWeights& w, ModelCopy copy) {
  const LerpRegisters lerp(f, w);
  auto* m_bits = static_cast<uint16_t*>(m.data);
  auto* v_bits = static_cast<uint16_t*>(v.data);
  avx512::MomentWords m_words(m.seed, m.first + static_cast<uint64_t>(begin));
  avx512::MomentWords v_words(v.seed, v.first + static_cast<uint64_t>(begin));
  constexpr int64_t kBlock = 256;  // the O2 copy is written a block at a time, while the block is in cache
  for (int64_t c = begin; c < end; c += kBlock) {
    const int64_t stop = std::min(end, c + kBlock);
    for (int64_t i = c; i < stop; i += 32) {
      const __m512i m_random = m_words.next(), v_random = v_words.next();
      for (int half = 0; half < 2; ++half) {
        const int64_t k = i + 16 * half;
        __m512 mi, vi;
        adam_lerp16<L2, STORE_GRAD>(p + k, g + k, widen_bf16(m_bits + k), widen_bf16(v_bits + k), lerp, &mi, &vi);
        const __m256i m_half = half == 0 ? avx512::low_words(m_random) : avx512::high_words(m_random);
        const __m256i v_half = half == 0 ? avx512::low_words(v_random) : avx512::high_words(v_random);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(m_bits + k), avx512::round16_stochastically(mi, m_half));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(v_bits + k), avx512::round16_stochastically(vi, v_half));
      }
    }
    if (copy.data != nullptr) {
      const int64_t bytes = copy.dtype == Dtype::Float ? 4 : 2;
      convert(p + c, copy.dtype, static_cast<char*>(copy.data) + c * bytes, stop - c);
    }
  }
}
#endif

#ifdef AMP_HAVE_SIMD_LOOPS
// adam_lerp16's registers and arithmetic with AVX2's 8 lanes: the AVX2 one-pass loops below share them.
struct LerpRegisters8 {
  __m256 decay, inv, wd, coeff1, coeff2, bc2_sqrt, eps, neg_step;
  __m256 base1, base2;  // all ones where the lerp base is the moment
  AMP_AVX2 LerpRegisters8(const AdamFloats& f, const LerpWeights& w)
      : decay(_mm256_set1_ps(f.decay)), inv(_mm256_set1_ps(f.inv)), wd(_mm256_set1_ps(f.wd)),
        coeff1(_mm256_set1_ps(w.coeff1)), coeff2(_mm256_set1_ps(w.coeff2)), bc2_sqrt(_mm256_set1_ps(f.bc2_sqrt)),
        eps(_mm256_set1_ps(f.eps)), neg_step(_mm256_set1_ps(f.neg_step_size)),
        base1(_mm256_castsi256_ps(_mm256_set1_epi32(w.small1 ? -1 : 0))),
        base2(_mm256_castsi256_ps(_mm256_set1_epi32(w.small2 ? -1 : 0))) {}
};

template <bool L2, bool STORE_GRAD>
AMP_AVX2 inline void adam_lerp8(float* p, float* g, __m256 mo, __m256 vo, const LerpRegisters8& r, __m256* mi,
                                __m256* vi) {
  const __m256 param = _mm256_mul_ps(_mm256_loadu_ps(p), r.decay);
  __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g), r.inv);
  if constexpr (STORE_GRAD) _mm256_storeu_ps(g, gi);
  if constexpr (L2) gi = _mm256_add_ps(gi, _mm256_mul_ps(r.wd, param));
  const __m256 square = _mm256_mul_ps(gi, gi);
  *mi = _mm256_fmadd_ps(r.coeff1, _mm256_sub_ps(gi, mo), _mm256_blendv_ps(gi, mo, r.base1));
  *vi = _mm256_fmadd_ps(r.coeff2, _mm256_sub_ps(square, vo), _mm256_blendv_ps(square, vo, r.base2));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(*vi), r.bc2_sqrt), r.eps);
  _mm256_storeu_ps(p, _mm256_add_ps(param, _mm256_div_ps(_mm256_mul_ps(r.neg_step, *mi), denom)));
}

AMP_AVX2 inline __m256 widen_bf16x8(const uint16_t* bits) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

// The 8-bit step in one pass with AVX2 (NOTE [The 8-bit step in one pass]): 8 values a vector, decoding by gathers
// and finding codes on the maps' lines (or through the bucket table); the block before is encoded inside this
// block's loop, as with AVX-512. The portable loops' bits (EightBitAdamStepOnEveryLoop).
AMP_AVX2 inline void encode_scratch8(const StateView& view, int64_t at, const float* values, __m256i absmax) {
  if (!avx2::encode_block(values, absmax, static_cast<uint8_t*>(view.data) + at, view.scales + at / kCodeBlock,
                          view.buckets, view.lines)) {
    encode(view, at, kCodeBlock, values);  // inf or NaN: the codec's search
  }
}

// LINES: both moments' maps have lines, m's signed and v's not.
template <bool L2, bool STORE_GRAD, bool LINES>
AMP_AVX2 void adam_lerp_codes_avx2(float* p, float* g, const StateView& m, const StateView& v, int64_t begin,
                                   int64_t end, const AdamFloats& f, const LerpWeights& w, ModelCopy copy) {
  alignas(32) float scratch[2][2][kCodeBlock];  // [block parity][moment]
  const LerpRegisters8 lerp(f, w);
  const auto* m_codes = static_cast<const uint8_t*>(m.data);
  const auto* v_codes = static_cast<const uint8_t*>(v.data);
  static const CodeLines kNoLines{};  // unused without LINES
  const avx2::LineRegisters m_lines(LINES ? *m.lines : kNoLines), v_lines(LINES ? *v.lines : kNoLines);
  PendingBlock pending;
  __m256i pending_m_max = _mm256_setzero_si256(), pending_v_max = _mm256_setzero_si256();
  // The pending block's encoding, 8 values at a time inside the next block's loop (its scale is known by then).
  __m256 pm_s = _mm256_setzero_ps(), pm_r = pm_s, pv_s = pm_s, pv_r = pm_s;
  float pm = 0, pv = 0;  // the pending block's scales
  bool pm_fast = false, pv_fast = false, pm_recip = false, pv_recip = false;
  for (int64_t c = begin; c < end; c += kCodeBlock) {
    float* m_out = scratch[(c / kCodeBlock) & 1][0];
    float* v_out = scratch[(c / kCodeBlock) & 1][1];
    const __m256 m_scale = _mm256_set1_ps(m.scales[c / kCodeBlock]), v_scale = _mm256_set1_ps(v.scales[c / kCodeBlock]);
    __m256i m_max = _mm256_setzero_si256(), v_max = _mm256_setzero_si256();
    for (int64_t j = 0; j < kCodeBlock; j += 8) {
      const int64_t i = c + j;
      __m256 mi, vi;
      adam_lerp8<L2, STORE_GRAD>(p + i, g + i, avx2::decode8(m_codes + i, m_scale, m.map),
                                 avx2::decode8(v_codes + i, v_scale, v.map), lerp, &mi, &vi);
      _mm256_store_ps(m_out + j, mi);
      _mm256_store_ps(v_out + j, vi);
      m_max = avx2::absmax_bits(m_max, mi);
      v_max = avx2::absmax_bits(v_max, vi);
      if (pm_fast) {
        uint8_t* to = static_cast<uint8_t*>(m.data) + pending.at + j;
        if constexpr (LINES) {
          avx2::codes8_by_lines<true>(pending.m + j, pm_s, pm_r, pm_recip, pm, m_lines, m.buckets, to);
        } else {
          avx2::codes8(avx2::divide8(_mm256_load_ps(pending.m + j), pm_s, pm_r, pm_recip), m.buckets, to);
        }
      }
      if (pv_fast) {
        uint8_t* to = static_cast<uint8_t*>(v.data) + pending.at + j;
        if constexpr (LINES) {
          avx2::codes8_by_lines<false>(pending.v + j, pv_s, pv_r, pv_recip, pv, v_lines, v.buckets, to);
        } else {
          avx2::codes8(avx2::divide8(_mm256_load_ps(pending.v + j), pv_s, pv_r, pv_recip), v.buckets, to);
        }
      }
    }
    if (pending.at >= 0) {  // a moment with inf or NaN: the codec's own loop, after
      if (!pm_fast) encode_scratch8(m, pending.at, pending.m, pending_m_max);
      if (!pv_fast) encode_scratch8(v, pending.at, pending.v, pending_v_max);
    }
    if (copy.data != nullptr) {
      const int64_t bytes = copy.dtype == Dtype::Float ? 4 : 2;
      convert(p + c, copy.dtype, static_cast<char*>(copy.data) + c * bytes, kCodeBlock);
    }
    // This block becomes the pending one; its scales are written now, as nothing reads them again.
    pending = PendingBlock{m_out, v_out, c};
    pending_m_max = m_max, pending_v_max = v_max;
    const float sm = avx2::block_scale(m_max), sv = avx2::block_scale(v_max);
    pm_fast = std::isfinite(sm), pv_fast = std::isfinite(sv);
    pm = sm, pv = sv;
    if (pm_fast) {
      m.scales[c / kCodeBlock] = sm;
      pm_s = _mm256_set1_ps(sm), pm_r = _mm256_set1_ps(1.0f / sm), pm_recip = divides_by_reciprocal(sm);
    }
    if (pv_fast) {
      v.scales[c / kCodeBlock] = sv;
      pv_s = _mm256_set1_ps(sv), pv_r = _mm256_set1_ps(1.0f / sv), pv_recip = divides_by_reciprocal(sv);
    }
  }
  if (pending.at >= 0) {
    encode_scratch8(m, pending.at, pending.m, pending_m_max);
    encode_scratch8(v, pending.at, pending.v, pending_v_max);
  }
}

// The bf16 step in one pass with AVX2 (NOTE [The bf16 step in one pass]): 8 values a vector, 16 a draw vector, the
// same arithmetic and rounding. [begin, end) a multiple of 16 values long.
template <bool L2, bool STORE_GRAD>
AMP_AVX2 void adam_lerp_bf16_avx2(float* p, float* g, const StateView& m, const StateView& v, int64_t begin,
                                  int64_t end, const AdamFloats& f, const LerpWeights& w, ModelCopy copy) {
  const LerpRegisters8 lerp(f, w);
  auto* m_bits = static_cast<uint16_t*>(m.data);
  auto* v_bits = static_cast<uint16_t*>(v.data);
  avx2::MomentWords m_words(m.seed, m.first + static_cast<uint64_t>(begin));
  avx2::MomentWords v_words(v.seed, v.first + static_cast<uint64_t>(begin));
  constexpr int64_t kBlock = 256;  // the O2 copy is written a block at a time, while the block is in cache
  for (int64_t c = begin; c < end; c += kBlock) {
    const int64_t stop = std::min(end, c + kBlock);
    for (int64_t i = c; i < stop; i += 16) {
      const __m256i m_random = m_words.next(), v_random = v_words.next();
      for (int half = 0; half < 2; ++half) {
        const int64_t k = i + 8 * half;
        __m256 mi, vi;
        adam_lerp8<L2, STORE_GRAD>(p + k, g + k, widen_bf16x8(m_bits + k), widen_bf16x8(v_bits + k), lerp, &mi, &vi);
        const __m128i m_half = half == 0 ? _mm256_castsi256_si128(m_random) : _mm256_extracti128_si256(m_random, 1);
        const __m128i v_half = half == 0 ? _mm256_castsi256_si128(v_random) : _mm256_extracti128_si256(v_random, 1);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(m_bits + k), avx2::round8_stochastically(mi, m_half));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(v_bits + k), avx2::round8_stochastically(vi, v_half));
      }
    }
    if (copy.data != nullptr) {
      const int64_t bytes = copy.dtype == Dtype::Float ? 4 : 2;
      convert(p + c, copy.dtype, static_cast<char*>(copy.data) + c * bytes, stop - c);
    }
  }
}
#endif

}  // namespace

void adam_step_stored(float* param, float* grad, const StateView& exp_avg, const StateView& exp_avg_sq,
                      const StateView* max_exp_avg_sq, int64_t begin, int64_t end, const AdamScalars& s,
                      ModelCopy copy) {
  const AdamFloats f = adam_floats(s);
  const bool l2 = !s.decoupled_weight_decay && s.weight_decay != 0;
  const auto w1 = static_cast<float>(1 - s.beta1), w2 = static_cast<float>(1 - s.beta2);  // torchao's lerp weights
  const LerpWeights w{w1 < 0.5f ? w1 : w1 - 1.0f, w2 < 0.5f ? w2 : w2 - 1.0f, w1 < 0.5f, w2 < 0.5f};
#ifdef AMP_HAVE_AVX512_CODES
  if (!s.amsgrad && exp_avg.kind == StateKind::kCodes && exp_avg_sq.kind == StateKind::kCodes &&
      codec_loops_at(CodecLoops::kAvx512)) {
    const bool store = s.inv_scale != 1.0f;
    const bool lines = exp_avg.lines != nullptr && exp_avg.lines->mirror >= 0 && exp_avg_sq.lines != nullptr &&
                       exp_avg_sq.lines->mirror < 0;
    const auto loop = lines ? (l2 ? (store ? adam_lerp_codes<true, true, true> : adam_lerp_codes<true, false, true>)
                                  : (store ? adam_lerp_codes<false, true, true> : adam_lerp_codes<false, false, true>))
                            : (l2 ? (store ? adam_lerp_codes<true, true, false> : adam_lerp_codes<true, false, false>)
                                  : (store ? adam_lerp_codes<false, true, false> : adam_lerp_codes<false, false, false>));
    return loop(param, grad, exp_avg, exp_avg_sq, begin, end, f, w, copy);
  }
#endif
#ifdef AMP_HAVE_SIMD_LOOPS
  if (!s.amsgrad && exp_avg.kind == StateKind::kCodes && exp_avg_sq.kind == StateKind::kCodes &&
      codec_loops_at(CodecLoops::kAvx2)) {
    const bool store = s.inv_scale != 1.0f;
    const bool lines = exp_avg.lines != nullptr && exp_avg.lines->mirror >= 0 && exp_avg_sq.lines != nullptr &&
                       exp_avg_sq.lines->mirror < 0;
    const auto loop =
        lines ? (l2 ? (store ? adam_lerp_codes_avx2<true, true, true> : adam_lerp_codes_avx2<true, false, true>)
                    : (store ? adam_lerp_codes_avx2<false, true, true> : adam_lerp_codes_avx2<false, false, true>))
              : (l2 ? (store ? adam_lerp_codes_avx2<true, true, false> : adam_lerp_codes_avx2<true, false, false>)
                    : (store ? adam_lerp_codes_avx2<false, true, false> : adam_lerp_codes_avx2<false, false, false>));
    return loop(param, grad, exp_avg, exp_avg_sq, begin, end, f, w, copy);
  }
  // bf16 moments with stochastic rounding: whole vectors in one pass (NOTE [The bf16 step in one pass]), the rest
  // (fewer values than a vector) chunked below.
  if (!s.amsgrad && exp_avg.kind == StateKind::kBFloat16 && exp_avg.stochastic &&
      exp_avg_sq.kind == StateKind::kBFloat16 && exp_avg_sq.stochastic && codec_loops_at(CodecLoops::kAvx2)) {
    const bool store = s.inv_scale != 1.0f;
    const bool avx512 = codec_loops_at(CodecLoops::kAvx512);
    const auto loop = avx512 ? (l2 ? (store ? adam_lerp_bf16<true, true> : adam_lerp_bf16<true, false>)
                                   : (store ? adam_lerp_bf16<false, true> : adam_lerp_bf16<false, false>))
                             : (l2 ? (store ? adam_lerp_bf16_avx2<true, true> : adam_lerp_bf16_avx2<true, false>)
                                   : (store ? adam_lerp_bf16_avx2<false, true> : adam_lerp_bf16_avx2<false, false>));
    const int64_t vector = avx512 ? 32 : 16;
    const int64_t whole = begin + (end - begin) / vector * vector;
    loop(param, grad, exp_avg, exp_avg_sq, begin, whole, f, w, copy);
    begin = whole;
  }
#endif
  const auto range = l2 ? (s.amsgrad ? adam_lerp_l2_amsgrad : adam_lerp_l2) : (s.amsgrad ? adam_lerp_amsgrad : adam_lerp_plain);
  stored_chunks(exp_avg, exp_avg_sq, s.amsgrad ? max_exp_avg_sq : nullptr, begin, end,
                [&](int64_t c, int64_t n, float* m, float* v, float* x) {
                  range(param + c, grad + c, m, v, x, n, f, w, s.inv_scale != 1.0f);
                  if (copy.data != nullptr) {
                    const int64_t bytes = copy.dtype == Dtype::Float ? 4 : 2;
                    convert(param + c, copy.dtype, static_cast<char*>(copy.data) + c * bytes, n);
                  }
                });
}

void lamb_stage1_stored(const float* param, const float* grad, const StateView& exp_avg, const StateView& exp_avg_sq,
                        float* update, int64_t begin, int64_t end, const LambScalars& s) {
  stored_chunks(exp_avg, exp_avg_sq, nullptr, begin, end, [&](int64_t c, int64_t n, float* m, float* v, float*) {
    (s.adam_w_mode ? lamb_stage1_adam_w : lamb_stage1_l2)(param + c, grad + c, m, v, update + c, 0, n, s);
  });
}

void adam_step(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               int64_t n, const AdamScalars& s, ModelCopy copy) {
  const AdamFloats f = adam_floats(s);
  const bool l2 = !s.decoupled_weight_decay && s.weight_decay != 0;
  const auto range = l2 ? (s.amsgrad ? adam_l2_amsgrad : adam_l2) : (s.amsgrad ? adam_amsgrad : adam_plain);
  chunked(n, param, copy, [&](int64_t begin, int64_t end) {
    range(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, begin, end, f, s.inv_scale != 1.0f);
  });
}

void sgd_step(float* param, float* grad, float* momentum_buffer, int64_t n, const SgdScalars& s,
              ModelCopy copy) {
  chunked(n, param, copy, [&](int64_t begin, int64_t end) {
    sgd_range(param, grad, momentum_buffer, begin, end, s.inv_scale, static_cast<float>(s.weight_decay),
              static_cast<float>(s.momentum), static_cast<float>(1 - s.dampening), static_cast<float>(-s.lr),
              s.momentum != 0, s.nesterov, s.first_step, s.inv_scale != 1.0f);
  });
}

}  // namespace amp::detail::cpu
