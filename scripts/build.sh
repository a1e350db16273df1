#!/usr/bin/env bash
# Configures and builds amp against one LibTorch: scripts/build.sh [2.13|1.13|2.13-sanitize|cuda|custom|main] [cmake args...]
#   2.13           the torch==2.13.0 wheel's bundled LibTorch (build/torch-2.13)
#   main           the main job's build: the library and examples/train only, against the wheel (build/main)
#   cuda           the CUDA 13.0 build of torch==2.13.0 (PyPI's default wheel, in a venv: scripts/setup-cuda.sh)
#                  with CUDA code on (build/torch-cuda). Without a GPU: the library, the CUDA tests (they skip, saying
#                  why) and the install check only, the code that differs from the 2.13 flavor's (AMP_CUDA_TESTS_ONLY;
#                  AMP_CUDA_FULL=1 builds the whole suite anyway)
#   1.13           Debian's libtorch-dev 1.13.1 (build/torch-1.13)
#   2.13-sanitize  2.13 with AddressSanitizer + UndefinedBehaviorSanitizer (build/torch-2.13-sanitize)
#   custom         the LibTorch named by $Torch_DIR or $CMAKE_PREFIX_PATH, e.g. the official zip (build/torch-custom)
# Without an argument: custom if Torch_DIR/CMAKE_PREFIX_PATH is set, else 2.13.
set -euo pipefail
cd "$(dirname "$0")/.."

version=${1:-}
[ $# -gt 0 ] && shift
if [ -z "$version" ]; then
  if [ -n "${Torch_DIR:-}${CMAKE_PREFIX_PATH:-}" ]; then version=custom; else version=2.13; fi
fi
case "$version" in
  2.13|2.13-sanitize|main) torch_dir="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch" ;;
  1.13) torch_dir=/usr/lib/x86_64-linux-gnu/cmake/Torch
        [ -d "$torch_dir" ] || torch_dir="$(dirname "$(dpkg -L libtorch-dev | grep '/TorchConfig.cmake$' | head -n1)")" ;;
  cuda) venv=$(./scripts/setup-cuda.sh)
        site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
        torch_dir="$site/torch/share/cmake/Torch"
        cu="$site/nvidia/cu13"
        # TorchConfig -> Caffe2's cuda.cmake wants an nvcc of torch's CUDA version (no GPU needed), and
        # Caffe2Config pinned next to TorchConfig (Debian's 1.13 one is on the system paths too).
        cuda_args=(-DCaffe2_DIR="$torch_dir/../Caffe2" -DCUDA_TOOLKIT_ROOT_DIR="$cu" -DCUDAToolkit_ROOT="$cu"
                   -DCMAKE_CUDA_COMPILER="$cu/bin/nvcc") ;;
  custom) torch_dir="${Torch_DIR:-}" ;;
  *) echo "usage: scripts/build.sh [2.13|1.13|2.13-sanitize|cuda|custom|main] [cmake args...]" >&2; exit 2 ;;
esac

build_dir="build/torch-$version"
[ "$version" = main ] && build_dir=build/main
mkdir -p build
args=(-S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DAMP_BUILD_TESTS=ON -DAMP_BUILD_EXAMPLES=ON
      -DAMP_PYTHON_REFERENCE_CACHE="$PWD/build/python-references")  # shared by the flavors: each reference runs once
[ -n "$torch_dir" ] && args+=(-DTorch_DIR="$torch_dir")
# Examples and benchmarks are built and run in the 2.13 flavor. The others cover the library and the unit suite,
# which keeps CI's four cold builds inside its time (pass -DAMP_BUILD_EXAMPLES=ON to build and run the examples
# there too).
case "$version" in 1.13|2.13-sanitize|cuda) args+=(-DAMP_BUILD_EXAMPLES=OFF) ;; esac
# The docs' C++ blocks compile against both supported versions (2.13 and 1.13); the CUDA and sanitizer builds of
# 2.13 would compile the same text against the same headers again.
case "$version" in 2.13-sanitize|cuda) args+=(-DAMP_BUILD_DOC_SNIPPETS=OFF) ;; esac
# Each public header compiled alone and each library source parsed alone (one translation unit each), once, against
# the primary LibTorch; every flavor builds the library as users get it by default (in batches over precompiled
# headers; explicit: a build tree configured before keeps its cache).
[ "$version" = 2.13 ] || args+=(-DAMP_CHECK_HEADERS=OFF -DAMP_CHECK_SOURCES=OFF)
args+=(-DAMP_QUICK_LIBRARY_BUILD=ON)
# The tests' and examples' own code at -O0 (amp's library and the benchmarks as users build them): a batch of test files
# compiles in 0.4-0.6x the time, and the suite takes as long (what runs long in a test is LibTorch's and amp's code).
[ "$version" = main ] || args+=(-DAMP_TEST_CODE_OPTIMIZATION=-O0)
# -O1 -g1 for the sanitizers: the optimization level ASan's documentation recommends, and line tables, all a report
# needs; -O2 and full debug info slow this, the longest build.
[ "$version" = 2.13-sanitize ] && args+=(-DAMP_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG")
[ "$version" = cuda ] && args+=("${cuda_args[@]}")
# Without a GPU every other test would run the same code on the same CPU kernels as the 2.13 flavor.
if [ "$version" = cuda ]; then
  if [ "${AMP_CUDA_FULL:-0}" = 1 ] || nvidia-smi -L > /dev/null 2>&1; then
    args+=(-DAMP_CUDA_TESTS_ONLY=OFF)
  else
    args+=(-DAMP_CUDA_TESTS_ONLY=ON)
  fi
fi
targets=()
if [ "$version" = main ]; then
  # The main job trains within minutes of a fresh clone: no tests, no benchmarks, one example (no precompiled
  # header for a single file), and the library built in batches over one precompiled <torch/torch.h> (the test
  # flavors compile each source alone, so their includes stay checked).
  args+=(-DAMP_BUILD_TESTS=OFF -DAMP_BUILD_BENCH=OFF -DAMP_PRECOMPILE_TORCH=OFF)
  targets=(--target train)
  # Ninja (pip's, where the machine has it) compiles examples/train beside the library; make waits for the library.
  if command -v ninja > /dev/null && [ ! -f "$build_dir/Makefile" ]; then args+=(-G Ninja); fi
fi
# Ninja (Debian's ninja-build, which scripts/setup.sh installs) keeps both cores busy across targets where make waits for
# a target's last object; a tree configured with make before keeps make.
if [ "$version" != main ] && command -v ninja > /dev/null && [ ! -f "$build_dir/Makefile" ]; then args+=(-G Ninja); fi
cmake "${args[@]}" "$@" > "$build_dir.configure.log" 2>&1 || { mkdir -p build; cat "$build_dir.configure.log"; exit 1; }
cmake --build "$build_dir" -j "${AMP_JOBS:-2}" "${targets[@]}"
