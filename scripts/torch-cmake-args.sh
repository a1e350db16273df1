# Sourced by gpu-check.sh and cpu-check.sh: `torch_cmake_args BUILD_DIR` sets the array `args` to the CMake
# arguments that configure amp in BUILD_DIR against python3's PyTorch (Release; ninja where there is one; for a CUDA
# build of torch, the nvcc that matches it). Callers append their own options.
torch_cmake_args() {
  local torch_dir nvcc cuda_root
  torch_dir="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch"
  args=(-S . -B "$1" -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir")
  if command -v ninja > /dev/null; then args+=(-G Ninja); fi
  nvcc=$(command -v nvcc || true)
  if [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc; fi
  if [ -n "$nvcc" ]; then  # TorchConfig of a CUDA build wants the toolkit that matches it
    cuda_root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    args+=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCUDAToolkit_ROOT="$cuda_root" -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root")
  fi
}
