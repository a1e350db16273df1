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
compare=("$here/examples/finetune_torchvision/compare.py" "$build/examples/finetune_torchvision" "$out" --steps 50
         --timing-rounds 5)
# Every model in bfloat16 (and O0); float16 on the VisionTransformer only: float16 convolutions take a slow path on
# CPUs (resnet18 ~6 s a step where bfloat16 takes 0.1 s), which would make this run hours.
python3 -W ignore "${compare[@]}" --markdown "$out/table_bf16.md" --plot "$out/loss_curves.png" \
  --configs O0:float32:sgd,O0:float32:adamw,O1:bfloat16:sgd,O1:bfloat16:adamw,O2:bfloat16:sgd,O2:bfloat16:adamw,O3:bfloat16:sgd,O3:bfloat16:adamw
python3 -W ignore "${compare[@]}" --markdown "$out/table_fp16.md" --models vit \
  --configs O1:float16:sgd,O1:float16:adamw,O2:float16:sgd,O2:float16:adamw,O3:float16:sgd,O3:float16:adamw
