#!/usr/bin/env bash
# The main job: sets up, builds amp against LibTorch 2.13, and trains the digits classifier at the
# opt level of a config file. Extra arguments go to the trainer (they override the config):
#   scripts/train.sh                                   # examples/configs/O2_bf16.ini
#   scripts/train.sh --config examples/configs/O1_bf16.ini --epochs 3
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
./scripts/setup.sh
./scripts/build.sh 2.13 > build/train-build.log 2>&1 || { tail -n 50 build/train-build.log; exit 1; }

# scikit-learn's digits (Debian's python3-sklearn ships them): 1797 8x8 images, 10 classes.
digits_gz=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
mkdir -p build/data
if [ -f "$digits_gz" ] && [ ! -s build/data/digits.csv ]; then gzip -dc "$digits_gz" > build/data/digits.csv; fi

args=("$@")
printf '%s\n' "${args[@]}" | grep -q -- '^--config' || args=(--config examples/configs/O2_bf16.ini "${args[@]}")
exec env OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" build/torch-2.13/examples/train --data build/data/digits.csv "${args[@]}"
