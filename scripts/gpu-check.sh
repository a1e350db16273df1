#!/usr/bin/env bash
# The one prepared GPU check: on a machine with an NVIDIA GPU, CUDA's nvcc, PyTorch built with CUDA, CMake
# and ninja, builds amp, its tests and examples against that PyTorch's LibTorch and runs the whole suite
# (the *_cuda variants run instead of skipping), then prints which CUDA tests ran and how they ended.
# GoogleTest, Boost and gloo's headers come from .gpu-bundle (scripts/gpu-bundle.sh, made on this
# project's Debian machines). Logs go to $OUT when set (the device tool), else build/gpu-check.
#   here:        scripts/gpu-bundle.sh
#   the device:  run "scripts/gpu-check.sh" with carry [".gpu-bundle"], timeout_s 600
# Without a GPU it still builds and runs the suite (the CUDA variants skip and say why).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${OUT:-build/gpu-check}")
build=$(realpath -m "${AMP_GPU_BUILD:-/tmp/amp-gpu-build}")
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
prefix="$PWD/.gpu-bundle/prefix"
[ -d "$prefix" ] || { echo "gpu-check: no .gpu-bundle here; run scripts/gpu-bundle.sh and carry .gpu-bundle"; exit 2; }

python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "available:",
            torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
torch_dir="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch"
args=(-S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir"
      -DCMAKE_PREFIX_PATH="$prefix" -DAMP_BUILD_TESTS=ON -DAMP_BUILD_EXAMPLES=ON)
command -v ninja > /dev/null && args+=(-G Ninja)
nvcc=$(command -v nvcc || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -n "$nvcc" ]; then  # TorchConfig of a CUDA build wants the toolkit that matches it
  cuda_root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  args+=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCUDAToolkit_ROOT="$cuda_root" -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root")
fi
start=$(date +%s)
cmake "${args[@]}" > "$out/configure.log" 2>&1 || { tail -n 60 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" > "$out/build.log" 2>&1 || { grep -m 20 -B2 -A8 "error" "$out/build.log"; exit 1; }
echo "gpu-check: built in $(( $(date +%s) - start )) s"
export LD_LIBRARY_PATH="$prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
(cd "$build" && OMP_NUM_THREADS=1 ctest --output-on-failure -j 4 --timeout 600 -LE long > "$out/ctest.log" 2>&1) || status=1
grep -E "tests passed|Total Test time" "$out/ctest.log"
grep -E "^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*_cuda " "$out/ctest.log" |
  sed -E 's/.*(Passed|Skipped|Failed|Timeout|Exception).*/\1/' | sort | uniq -c | sed 's/^/gpu-check: CUDA variants: /'
grep -E "\(Failed\)|\(Timeout\)|\(SEGFAULT\)" "$out/ctest.log" || true
exit $status
