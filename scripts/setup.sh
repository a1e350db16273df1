#!/usr/bin/env bash
# Installs what amp needs. Idempotent: a second run installs nothing.
#   scripts/setup.sh          everything the test suite, examples and benchmarks need (the test command):
#                             LibTorch 2.13 (CPU), bundled in the pip wheel torch==2.13.0 (the primary build),
#                             and LibTorch 1.13.1 (CPU), Debian's libtorch-dev (the second supported version)
#   scripts/setup.sh --main   only what the main job (scripts/train.sh) needs: the wheel, a compiler, CMake,
#                             Boost.Program_options and gloo's headers
set -euo pipefail

main_only=0
[ "${1:-}" = --main ] && main_only=1

if [ $main_only = 1 ]; then
  apt_packages=(libboost-program-options-dev libgloo-dev g++ make)
  command -v cmake > /dev/null || apt_packages+=(cmake)
else
  apt_packages=(libtorch-dev libgtest-dev libgmock-dev libbenchmark-dev libboost-program-options-dev
                ccache cmake g++ make ninja-build python3-sklearn gnuplot-nox clang libclang-rt-14-dev libgloo-dev)
fi
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The wheel's version is pinned: an unpinned `torch` would pull a multi-GB CUDA build.
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU wheel; its bundled LibTorch is what amp builds against)"
  python3 -m pip install --quiet torch==2.13.0
fi
[ $main_only = 1 ] && { echo "setup: done (main job)"; exit 0; }
# Python's tensorboard reads back the event files amp::SummaryWriter writes (tests/tensorboard_test.cpp,
# examples/tests/check_tensorboard.sh). It does not depend on torch, so the wheel above stays as it is.
if ! python3 -c 'import tensorboard, sys; sys.exit(0 if tensorboard.__version__ == "2.21.0" else 1)' 2>/dev/null; then
  echo "setup: installing tensorboard==2.21.0 (TensorBoard's reader, for the event-file tests)"
  python3 -m pip install --quiet tensorboard==2.21.0
fi
# torchao's AdamW8bit and Adam8bit are the reference the 8-bit optimizer states are compared with at test time
# (tests/python/state_formats.py). --no-deps: it must not replace the pinned torch.
if ! python3 -c 'import importlib.metadata as m, sys; sys.exit(0 if m.version("torchao") == "0.18.0" else 1)' 2>/dev/null; then
  echo "setup: installing torchao==0.18.0 (the 8-bit optimizer state reference, for the tests)"
  python3 -m pip install --quiet --no-deps torchao==0.18.0
fi
# torchvision's resnet18, mobilenet_v3_small and VisionTransformer are the real architectures examples/finetune_torchvision
# fine-tunes and compares with Python. --no-deps: 0.28.0 matches the torch wheel, which must stay as it is (this
# torchvision wheel is built for CUDA; its classification models run on the CPU torch: torchvision_models.py).
if ! python3 -c 'import importlib.metadata as m, sys; sys.exit(0 if m.version("torchvision") == "0.28.0" else 1)' 2>/dev/null; then
  echo "setup: installing torchvision==0.28.0 (the real models of examples/finetune_torchvision, for the tests)"
  python3 -m pip install --quiet --no-deps torchvision==0.28.0
fi
echo "setup: done"
