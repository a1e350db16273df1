#!/usr/bin/env bash
# Installs the CUDA build of LibTorch 2.13 for the `cuda` build flavor: PyPI's default Linux wheel of
# torch==2.13.0 (CUDA 13.0) with an nvcc of the same CUDA version (cuda-toolkit wheels), in a virtual
# environment of its own. No GPU is needed to build against it. Idempotent; prints the venv's path.
#   scripts/setup-cuda.sh            # -> build/venv-cuda-2.13 (or $AMP_CUDA_VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${AMP_CUDA_VENV:-$PWD/build/venv-cuda-2.13}
python=$venv/bin/python
installed() {
  "$python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") and torch.version.cuda else 1)' \
    2>/dev/null && ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc > /dev/null 2>&1
}
if ! installed; then
  echo "setup-cuda: installing torch==2.13.0 (CUDA 13.0 build, ~2.6 GB) and cuda-toolkit 13.0.3 into $venv" >&2
  python3 -m venv "$venv"
  # --isolated: this machine's pip configuration prefers the local CPU wheel; isolated mode ignores it, so the
  # CA bundle it names is passed by hand.
  cert=$(python3 -m pip config get global.cert 2>/dev/null || true)
  # A stalled download fails within 20 minutes and says so, rather than holding CI (isolated mode also drops the
  # configured socket timeout and retries, so they are given here).
  timeout 1200 "$python" -m pip install --isolated ${cert:+--cert "$cert"} --quiet --disable-pip-version-check \
    --timeout 60 --retries 3 torch==2.13.0 "cuda-toolkit[nvcc,cccl,crt,nvvm]==13.0.3" >&2 ||
    { echo "setup-cuda: installing the CUDA wheels failed or took over 20 minutes (see pip's output above)" >&2; exit 1; }
fi
site=$("$python" -c 'import site; print(site.getsitepackages()[0])')
# The nvidia-* wheels ship only versioned sonames (libcudart.so.13); CMake's FindCUDAToolkit looks for
# libcudart.so, and nvcc (driven with -m64 by CMake's compiler check) links from lib64.
for d in "$site"/nvidia/*/lib; do
  for f in "$d"/lib*.so.*; do
    [ -e "$f" ] || continue
    base=$(basename "$f"); dev="$d/${base%%.so.*}.so"
    [ -e "$dev" ] || ln -s "$base" "$dev"
  done
done
[ -e "$site/nvidia/cu13/lib64" ] || ln -s lib "$site/nvidia/cu13/lib64"
echo "$venv"
