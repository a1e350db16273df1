#!/usr/bin/env bash
# docs/real-models.md's table and plot: examples/finetune_torchvision's three torchvision models at every level and
# dtype, with SGD and AdamW, 50 steps each, C++ beside Python (examples/finetune_torchvision/compare.py), step times the
# median of 5 alternating runs on 1 thread. The CPU's flags are printed with the table.
#   bench/real_models.sh [BUILD_DIR] [OUT_DIR]      (defaults: build/torch-2.13, build/real_models)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build/torch-2.13}
out=${2:-$here/build/real_models}
mkdir -p "$out"
export OMP_NUM_THREADS=1
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-); flags:" \
     "$(grep -m1 -o -w -E 'avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
python3 -W ignore "$here/examples/finetune_torchvision/compare.py" "$build/examples/finetune_torchvision" "$out" \
  --steps 50 --timing-rounds 5 --markdown "$out/table.md" --plot "$out/loss_curves.png"
