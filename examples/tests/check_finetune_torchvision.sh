#!/usr/bin/env bash
# Exercises examples/finetune_torchvision: Python builds resnet18, mobilenet_v3_small and a VisionTransformer with
# torchvision, pretrains and scripts them; C++ fine-tunes each for a few steps at O0 (SGD), O1 bf16 (AdamW), O2 (SGD,
# fp16 but for resnet18) and O3 bf16 (AdamW), and at O3 fp16 with AdamW, which amp refuses (eps 1e-8 rounds to 0 in
# fp16); compare.py
# checks every run against Python training the same way: bitwise where the same ops run, else within twice Python's
# own run-to-run spread, the same loss scales, BatchNorm statistics unchanged (exit 77: no Python torch or
# torchvision, or a LibTorch other than Python's). bench/real_models.sh runs the full 50 steps and the timings.
#   check_finetune_torchvision.sh BINARY WORK_DIR
set -euo pipefail
python=${AMP_PYTHON:-python3}
"$python" -c 'import torch' 2> /dev/null || { echo "skipped: needs Python with the torch wheel"; exit 77; }
"$python" -c 'import importlib.metadata as m; m.version("torchvision")' 2> /dev/null ||
  { echo "skipped: needs torchvision==0.28.0 (scripts/setup.sh installs it)"; exit 77; }
here=$(cd "$(dirname "$0")/../finetune_torchvision" && pwd)
rm -rf "$2" && mkdir -p "$2"
# float16 convolutions take a slow path on CPUs (docs/real-models.md): resnet18 runs in bfloat16 only.
"$python" -W ignore "$here/compare.py" "$1" "$2" --steps 3 --pretrain-steps 10 --models resnet18 \
  --configs O0:float32:sgd,O1:bfloat16:adamw,O2:bfloat16:sgd,O3:bfloat16:adamw
# A mistyped optimizer, a missing --model or a step count of 0 is an error naming it and what to give instead.
expect_error() {  # expect_error MESSAGE ARGS...
  local message=$1 out
  shift
  if out=$("$@" 2>&1); then echo "FAIL: $* succeeded"; exit 1; fi
  echo "$out" | grep -qF -- "$message" || { echo "FAIL: $* said: $out"; exit 1; }
}
expect_error "--optimizer 'adam' is not one of sgd, adamw, fused_sgd, fused_adamw" \
  "$1" --model "$2/vit.pt" --data "$2/data.pt" --optimizer adam
expect_error "give --model and --data" "$1" --data "$2/data.pt"
expect_error "--steps (0) and --batch (16) must be at least 1" "$1" --model "$2/vit.pt" --data "$2/data.pt" --steps 0
"$python" -W ignore "$here/compare.py" "$1" "$2" --steps 3 --models mobilenet_v3_small,vit \
  --configs O0:float32:sgd,O1:bfloat16:adamw,O2:float16:sgd,O3:bfloat16:adamw,O3:float16:adamw
