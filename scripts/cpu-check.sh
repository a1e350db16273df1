#!/usr/bin/env bash
# The CPU measurements that wait for a CPU this project's own machines lack (an Intel Xeon with AVX-512 VBMI and AMX,
# as the device machines' hosts may have), in one call of under 10 minutes. Builds amp_bench against the machine's
# PyTorch (or reuses scripts/gpu-check.sh's build) and runs, one thread (OMP_NUM_THREADS=1):
#   1. amp_bench --section state_formats: the fused AdamW step with fp32, bf16 and 8-bit moments, the 8-bit step by
#      each decode the CPU has and the one amp times as the faster (docs/benchmarks.md, "Optimizer state formats");
#   2. bench/versus_python.py: O1 bf16 against Python torch.amp on the same wheel (docs/benchmarks.md, "C++ versus
#      Python"), AMP_CPU_CHECK_ROUNDS rounds (default 5; 3 where less time is left).
# and prints the CPU's model and the flags both depend on. Everything goes to $OUT when set, else build/cpu-check.
#   here:        scripts/gpu-bundle.sh
#   the device:  run "scripts/cpu-check.sh" with carry [".gpu-bundle"], timeout_s 600
# On this project's machines: AMP_CPU_CHECK_BUILD=build/torch-2.13 scripts/cpu-check.sh (reuses that build).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${OUT:-build/cpu-check}")
build=$(realpath -m "${AMP_CPU_CHECK_BUILD:-${AMP_GPU_BUILD:-/tmp/amp-gpu-build}}")
mkdir -p "$out"
exec > >(tee "$out/cpu-check.log") 2>&1
begin=$(date +%s)
deadline=$(( begin + ${AMP_CPU_CHECK_SECONDS:-560} ))
stage() { echo "cpu-check: [$(( $(date +%s) - begin )) s] $*"; }
left() { echo $(( deadline - $(date +%s) )); }

python3 -c 'import torch' 2> /dev/null || { echo "cpu-check: python3 cannot import torch"; exit 2; }
echo "cpu-check: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores"
flags=$(grep -m1 '^flags' /proc/cpuinfo)
echo "cpu-check: flags:$(for f in avx2 fma avx512f avx512bw avx512vbmi avx512_bf16 avx512_fp16 amx_bf16 amx_tile; do
  [[ " $flags " == *" $f "* ]] && printf ' %s+' "$f" || printf ' %s-' "$f"; done)"
grep -H . /sys/devices/system/cpu/vulnerabilities/gather_data_sampling 2> /dev/null || true
python3 -c 'import torch; print("cpu-check: torch", torch.__version__, torch.backends.cpu.get_cpu_capability())'

if [ ! -x "$build/bench/amp_bench" ]; then
  prefix="$PWD/.gpu-bundle/prefix"
  source scripts/torch-cmake-args.sh
  torch_cmake_args "$build"
  args+=(-DAMP_BUILD_TESTS=OFF)
  if [ -d "$prefix" ]; then args+=(-DCMAKE_PREFIX_PATH="$prefix"); fi
  stage "configuring and building amp_bench in $build"
  cmake "${args[@]}" > "$out/configure.log" 2>&1 || { tail -n 60 "$out/configure.log"; exit 1; }
  cmake --build "$build" -j "$(nproc)" --target amp_bench > "$out/build.log" 2>&1 ||
    { grep -m 20 -B2 -A8 "error" "$out/build.log"; exit 1; }
fi
if [ -d "$PWD/.gpu-bundle/prefix" ]; then
  export LD_LIBRARY_PATH="$PWD/.gpu-bundle/prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export OMP_NUM_THREADS=1
status=0

stage "1. amp_bench --section state_formats --reps 5 (limit 120 s)"
timeout 120 "$build/bench/amp_bench" --section state_formats --reps 5 > "$out/state-formats.md" || status=1
sed -n '/^The fused AdamW step alone/,$p' "$out/state-formats.md"

rounds=${AMP_CPU_CHECK_ROUNDS:-5}
if (( $(left) < 300 && rounds > 3 )); then rounds=3; fi
t=$(left)
if (( t > 60 )); then
  stage "2. bench/versus_python.py --rounds $rounds (limit $t s)"
  timeout "$t" python3 bench/versus_python.py "$build/bench/amp_bench" --rounds "$rounds" \
    --csv "$out/versus-python.csv" > "$out/versus-python.md" || status=1
  sed -n '/^## C++ versus Python/,$p' "$out/versus-python.md"
else
  status=1; echo "cpu-check: no time left for versus_python.py"
fi
stage "done, status $status; results in $out"
exit $status
