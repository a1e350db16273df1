#!/usr/bin/env bash
# examples/train with FP8 (examples/configs/O2_bf16_fp8.ini: a hidden Linear layer in FP8, delayed scaling) against
# O2 bf16 on the same network: the final validation accuracy must be within 1 point, the run must differ from bf16
# (FP8 really ran), and a run stopped after epoch 2 and resumed for one more must continue bitwise (the FP8 amax
# history is in the checkpoint). Also with dynamic scaling (--fp8-scaling dynamic), torchao's rowwise recipe and
# MXFP8 with auto_fallback on (docs/fp8.md's recipes; blockwise needs layers of 128).
#   check_train_fp8.sh TRAIN_BINARY WORK_DIR CONFIG_DIR
set -euo pipefail
train=$1 work=$2 configs=$3
rm -rf "$work" && mkdir -p "$work"
digits_gz=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
data="$work/digits.csv"
[ -f "$digits_gz" ] && gzip -dc "$digits_gz" > "$data"
common=(--data "$data" --verbosity 0 --seed 3)
# LibTorch before 2.1 has no FP8: the example says so, and this check is skipped (exit 77).
if ! out=$("$train" --config "$configs/O2_bf16_fp8.ini" --data "$data" --verbosity 0 --epochs 0 2>&1); then
  if echo "$out" | grep -q "which LibTorch has from 2.1 on"; then echo "skipped: $out"; exit 77; fi
  echo "$out"; exit 1
fi

"$train" --config "$configs/O2_bf16.ini" --hidden 64 "${common[@]}" --epochs 6 --metrics "$work/bf16.csv" > "$work/bf16.log"
"$train" --config "$configs/O2_bf16_fp8.ini" "${common[@]}" --epochs 6 --metrics "$work/fp8.csv" --checkpoint "$work/a.pt" > "$work/fp8.log"
"$train" --config "$configs/O2_bf16_fp8.ini" "${common[@]}" --epochs 6 --fp8-scaling dynamic --metrics "$work/dyn.csv" > "$work/dyn.log"
"$train" --config "$configs/O2_bf16_fp8.ini" "${common[@]}" --epochs 6 --fp8-scaling rowwise --metrics "$work/rowwise.csv" > "$work/rowwise.log"
"$train" --config "$configs/O2_bf16_fp8.ini" "${common[@]}" --epochs 6 --fp8-scaling mxfp8 --fp8-auto-fallback true \
  --metrics "$work/mxfp8.csv" > "$work/mxfp8.log"
"$train" --config "$configs/O2_bf16_fp8.ini" "${common[@]}" --epochs 2 --metrics "$work/b.csv" --checkpoint "$work/b.pt" > /dev/null
"$train" --config "$configs/O2_bf16_fp8.ini" "${common[@]}" --epochs 3 --metrics "$work/b.csv" --checkpoint "$work/b.pt" --resume true > /dev/null
cat "$work/fp8.log"

strip_time() { cut -d, -f1-7 "$1"; }
# The learning rate depends on the epoch alone, so the run resumed to epoch 3 is the uninterrupted run's first 3 epochs.
if ! diff <(strip_time "$work/fp8.csv" | head -n 4) <(strip_time "$work/b.csv"); then
  echo "FAIL: the resumed FP8 run differs from the uninterrupted one"; exit 1
fi
if diff -q <(strip_time "$work/bf16.csv") <(strip_time "$work/fp8.csv") > /dev/null; then
  echo "FAIL: the FP8 run equals the bf16 one (FP8 never ran)"; exit 1
fi
for run in fp8 dyn rowwise mxfp8; do
  paste -d, "$work/bf16.csv" "$work/$run.csv" | awk -F, -v run="$run" 'NR == 7 { bf16 = $5; fp8 = $15 }
    END { d = fp8 - bf16; if (d < 0) d = -d
          if (!(fp8 > 0.9) || !(d <= 0.01)) { print "FAIL: " run ": accuracy " fp8 " vs bf16 " bf16; exit 1 }
          print "ok: " run ": validation accuracy " fp8 " vs O2 bf16 " bf16 " (within 1 point)" }'
done
echo "ok: the FP8 run resumed after epoch 2 continues bitwise"
