#!/usr/bin/env bash
# The one prepared GPU check. On a machine with an NVIDIA GPU, nvcc, PyTorch built with CUDA, CMake and
# ninja: builds amp, its tests, examples and benchmarks against that PyTorch's LibTorch, runs the whole suite
# (the CUDA variants run instead of skipping; Fp8RecipeCudaTest compares each FP8 recipe on the GPU with the CPU),
# then the GPU benchmark (bench/gpu_bench.cpp), its FP8 sections (O2 bf16 against each FP8 recipe; the per-shape
# table min_gemm_size is read from), eager against CUDA-graphed steps and its Python torch.amp twin, and prints a summary, all within 8 minutes: after the build, each stage gets a share of
# what is left before a 7.5-minute deadline (AMP_GPU_CHECK_SECONDS) and is cut off there.
# GoogleTest, Boost and gloo's headers come from .gpu-bundle (scripts/gpu-bundle.sh, made on this project's
# Debian machines). Everything goes to $OUT when set (the device tool), else build/gpu-check.
#   here:        scripts/gpu-bundle.sh
#   the device:  run "scripts/gpu-check.sh" with carry [".gpu-bundle"], timeout_s 600
# Without a GPU it stops before building and says why. AMP_GPU_CHECK_DRY_RUN=1 runs every stage on the CPU
# instead (CUDA variants skip, the benchmarks run tiny): it checks this script, it measures nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${OUT:-build/gpu-check}")
build=$(realpath -m "${AMP_GPU_BUILD:-/tmp/amp-gpu-build}")
dry=${AMP_GPU_CHECK_DRY_RUN:-0}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
begin=$(date +%s)
stage() { echo "gpu-check: [$(( $(date +%s) - begin )) s] $*"; }

# Preconditions, all before any work: a half-run check is worse than none.
prefix="$PWD/.gpu-bundle/prefix"
[ -d "$prefix" ] || { echo "gpu-check: no .gpu-bundle here; run scripts/gpu-bundle.sh and carry .gpu-bundle"; exit 2; }
python3 -c 'import torch' 2> /dev/null || { echo "gpu-check: python3 cannot import torch; this needs PyTorch built with CUDA"; exit 2; }
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU:",
            torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  if [ "$dry" != 1 ]; then
    echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False), so nothing was built or run."
    echo "gpu-check: run this on a GPU machine; on a CPU machine use scripts/test.sh (or AMP_GPU_CHECK_DRY_RUN=1 to test this script)."
    exit 2
  fi
  echo "gpu-check: DRY RUN on the CPU (AMP_GPU_CHECK_DRY_RUN=1): CUDA tests skip, benchmark figures mean nothing"
  tiny=(--device cpu --steps 1 --reps 1 --batch 2 --models gpu_cnn)  # fp16 convolutions crawl on a CPU
  bench_args=("${tiny[@]}" --configs "O0 fp32,O1 bf16,O2 bf16,O3 bf16")
  fp8_args=(--device cpu --steps 1 --reps 1 --batch 2 --fp8-steps 2)
  shape_args=(--device cpu --steps 1 --reps 1 --batch 2)
  graph_args=(--device cpu --steps 1 --reps 1 --batch 2 --models mlp --configs "O1 bf16,O2 bf16")
  py_args=("${tiny[@]}" --configs "O0 fp32,O1 bf16")
else
  nvidia-smi -L 2> /dev/null || true
  bench_args=(--device cuda --steps 20 --reps 3)
  py_args=(--device cuda --steps 20 --reps 3)
  fp8_args=(--device cuda --steps 20 --reps 3 --fp8-steps 100)
  shape_args=(--device cuda --steps 10 --reps 3)
  graph_args=(--device cuda --steps 20 --reps 3)
fi

source scripts/torch-cmake-args.sh
torch_cmake_args "$build"
args+=(-DCMAKE_PREFIX_PATH="$prefix" -DAMP_BUILD_TESTS=ON -DAMP_BUILD_EXAMPLES=ON -DAMP_CTEST_PER_TEST=ON)
stage "configuring and building"
cmake "${args[@]}" > "$out/configure.log" 2>&1 || { tail -n 60 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" > "$out/build.log" 2>&1 || { grep -m 20 -B2 -A8 "error" "$out/build.log"; exit 1; }
stage "built"
export LD_LIBRARY_PATH="$prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# Every stage after the build gets what is left before the deadline, less what the stages after it need.
# 7.5 minutes on a GPU machine, so the whole check stays under 8; a dry run on a small CPU machine gets 20.
seconds=${AMP_GPU_CHECK_SECONDS:-$([ "$dry" = 1 ] && echo 1200 || echo 450)}
deadline=$(( begin + seconds ))
limit() {  # limit MAX RESERVE: seconds a stage may take (0: no time left)
  local left=$(( deadline - $(date +%s) - $2 ))
  (( left > $1 )) && left=$1
  (( left > 0 )) && echo "$left" || echo 0
}
status=0
t=$(limit 170 260)
if [ "$t" -gt 0 ]; then
  stage "running the suite (limit $t s)"
  (cd "$build" && OMP_NUM_THREADS=1 timeout "$t" ctest --output-on-failure -j "$(nproc)" --timeout "$t" -LE long \
     > "$out/ctest.log" 2>&1) || status=1
  grep -E "tests passed|Total Test time" "$out/ctest.log" || echo "gpu-check: the suite did not finish (see ctest.log)"
  grep -E "^ *[0-9]+/[0-9]+ Test +#[0-9]+: [^ ]*(_cuda|/cuda|Cuda)" "$out/ctest.log" |
    sed -E 's/.*(Passed|Skipped|Failed|Timeout|Exception).*/\1/' | sort | uniq -c | sed 's/^/gpu-check: CUDA variants: /'
  grep -E "\(Failed\)|\(Timeout\)|\(SEGFAULT\)|\*\*\*Exception" "$out/ctest.log" || true
else
  status=1; echo "gpu-check: no time left for the suite"
fi

# One amp_gpu_bench run, cut off at its share: bench_stage TITLE MAX RESERVE NAME ARGS... writes $out/NAME.{csv,md}.
bench_stage() {
  local title=$1 max=$2 reserve=$3 name=$4 t
  shift 4
  t=$(limit "$max" "$reserve")
  if [ "$t" -gt 0 ]; then
    stage "GPU benchmark: $title (limit $t s)"
    timeout "$t" "$build/bench/amp_gpu_bench" "$@" --csv "$out/$name.csv" > "$out/$name.md" ||
      { status=1; echo "gpu-check: amp_gpu_bench ($title) failed or ran out of time"; }
  else
    status=1; echo "gpu-check: no time left for amp_gpu_bench ($title)"
  fi
}
bench_stage "amp" 80 180 gpu-bench-cpp "${bench_args[@]}"
# Blockwise FP8 has a cuBLAS kernel from CUDA 12.9 on SM 9.0 (amp emulates it on every device for now); say what
# this machine would offer, so the figures below read right.
python3 -c 'import torch
cuda = torch.version.cuda or "none"; cc = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
ok = cc is not None and cc >= (9, 0) and cuda != "none" and tuple(int(v) for v in cuda.split(".")[:2]) >= (12, 9)
print("gpu-check: blockwise FP8: wheel CUDA", cuda, "compute capability", cc, "->",
      "cuBLAS 1x128/128x128 kernels available (amp still emulates)" if ok else "no blockwise kernel (amp emulates)")' || true
# FP8 Linear layers (docs/fp8.md): O2 bf16 against O2 + each FP8 recipe, step time and held-out loss.
bench_stage "FP8" 60 120 gpu-bench-fp8 --section fp8 "${fp8_args[@]}"
# The per-shape table min_gemm_size is read from: one Linear, bf16 against FP8 dynamic and rowwise.
bench_stage "FP8 per GEMM shape" 30 100 gpu-bench-fp8-shapes --section fp8_shapes "${shape_args[@]}"
# The whole step in one CUDA graph (docs/cuda.md): eager against graphed, O1/O2 in fp16 and bf16.
bench_stage "eager against CUDA-graphed steps" 40 60 gpu-bench-graph --section graph "${graph_args[@]}"
cat "$out/gpu-bench-fp8.md" "$out/gpu-bench-fp8-shapes.md" "$out/gpu-bench-graph.md" 2> /dev/null || true
t=$(limit 60 0)
if [ "$t" -gt 0 ]; then
  stage "GPU benchmark: Python torch.amp twin (limit $t s)"
  timeout "$t" python3 bench/python_amp.py "${py_args[@]}" > "$out/gpu-bench-python.csv" ||
    { status=1; echo "gpu-check: python_amp.py --device failed or ran out of time"; }
else
  status=1; echo "gpu-check: no time left for python_amp.py"
fi
if [ -s "$out/gpu-bench-cpp.csv" ] && [ -s "$out/gpu-bench-python.csv" ]; then
  python3 bench/report.py --gpu "$out/gpu-bench-cpp.csv" "$out/gpu-bench-python.csv" "$out/gpu-bench-cpp.md" \
    "$out/gpu-bench.md" "$out/gpu-bench.csv" || status=1
fi
stage "done, status $status; results in $out"
exit $status
