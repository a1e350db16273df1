#!/usr/bin/env bash
# Exercises examples/finetune_torchvision: Python builds resnet18, mobilenet_v3_small and a VisionTransformer with
# torchvision, pretrains and scripts them; C++ fine-tunes each at O0, O1, O2 and O3 (bf16, and fp16 at O1 and O2) with
# SGD and AdamW for a few steps, and compare.py checks every run against Python training the same way: O0 SGD bitwise,
# the others within twice Python's own run-to-run spread, the same loss scales, BatchNorm statistics unchanged
# (exit 77: no Python torch or torchvision). bench/real_models.sh runs the full 50 steps and the timings.
#   check_finetune_torchvision.sh BINARY WORK_DIR
set -euo pipefail
python=${AMP_PYTHON:-python3}
"$python" -c 'import torch' 2> /dev/null || { echo "skipped: needs Python with the torch wheel"; exit 77; }
"$python" -c 'import importlib.metadata as m; m.version("torchvision")' 2> /dev/null ||
  { echo "skipped: needs torchvision==0.28.0 (scripts/setup.sh installs it)"; exit 77; }
here=$(cd "$(dirname "$0")/../finetune_torchvision" && pwd)
rm -rf "$2" && mkdir -p "$2"
"$python" -W ignore "$here/compare.py" "$1" "$2" --steps 4 \
  --configs O0:float32:sgd,O0:float32:adamw,O1:bfloat16:adamw,O1:float16:sgd,O2:bfloat16:sgd,O2:float16:adamw,O3:bfloat16:sgd,O3:float16:adamw
