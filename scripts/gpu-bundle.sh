#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh needs that a GPU machine's image may lack (it brings CUDA, PyTorch, CMake
# and ninja): GoogleTest, Boost.Program_options and gloo's headers, copied from this machine's Debian
# packages into a prefix, .gpu-bundle/prefix (about 5 MB; git ignores it through .git/info/exclude).
# Carry it along: the device tool's `run` with carry [".gpu-bundle"] and the command scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh > /dev/null
lib=/usr/lib/x86_64-linux-gnu
out=.gpu-bundle/prefix
rm -rf .gpu-bundle
mkdir -p "$out/include" "$out/lib/x86_64-linux-gnu/cmake"
grep -qx '/.gpu-bundle/' .git/info/exclude 2>/dev/null || echo '/.gpu-bundle/' >> .git/info/exclude

# Boost: the headers src/interop/config.cpp reaches (3 MB of /usr/include/boost's 160), the library, its CMake
# package files (they locate include/ and lib/ relative to themselves).
torch_include="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')/../../include"
c++ -std=c++17 -M -Iinclude -Isrc -I. -isystem "$torch_include" -isystem "$torch_include/torch/csrc/api/include" \
    src/interop/config.cpp | tr ' \\' '\n\n' | grep '^/usr/include/boost/' | sort -u |
  while read -r header; do
    mkdir -p "$out/include/$(dirname "${header#/usr/include/}")"
    cp "$header" "$out/include/${header#/usr/include/}"
  done
cp -a "$lib"/libboost_program_options.* "$out/lib/x86_64-linux-gnu/"
cp -a "$lib"/cmake/Boost-* "$lib"/cmake/boost_headers-* "$lib"/cmake/boost_program_options-* \
      "$lib"/cmake/BoostDetectToolset-* "$out/lib/x86_64-linux-gnu/cmake/"

# GoogleTest (static libraries and their CMake package) and gloo's headers (amp::parallel).
cp -a /usr/include/gtest /usr/include/gmock /usr/include/gloo "$out/include/"
cp -a "$lib"/libgtest*.a "$lib"/libgmock*.a "$out/lib/x86_64-linux-gnu/"
cp -a "$lib/cmake/GTest" "$out/lib/x86_64-linux-gnu/cmake/"
echo "gpu-bundle: $(du -sh .gpu-bundle | cut -f1) in .gpu-bundle/prefix"
