#!/usr/bin/env bash
# Exercises --tensorboard in examples/train, segmentation and dcgan. Every run is read back by Python's
# tensorboard package (TensorBoard's EventMultiplexer, every CRC checked): each expected tag is there
# at every step; train's values equal its --metrics CSV; segmentation writes one run per configuration
# that ran and logging changes none of its results; an unwritable directory is a clear error.
# Exits 77 (ctest: skipped) without Python's tensorboard package.
#   check_tensorboard.sh TRAIN SEGMENTATION DCGAN WORK_DIR READER CONFIG_DIR
set -euo pipefail
train=$1 segmentation=$2 dcgan=$3 work=$4 reader=$5 configs=$6
if ! python3 -c 'import tensorboard' 2> /dev/null; then
  echo "SKIPPED: Python's tensorboard package is not installed (scripts/setup.sh installs it)"
  exit 77
fi
rm -rf "$work" && mkdir -p "$work"
runs="$work/runs"

"$train" --config "$configs/O2_bf16.ini" --verbosity 0 --epochs 3 --metrics "$work/train.csv" \
  --clip-grad-norm 1.0 --tensorboard "$runs/train" > "$work/train.log"
seg=(--epochs 2 --images 64 --modes O0,O2_bf16)
"$segmentation" "${seg[@]}" --tensorboard "$runs/segmentation" > "$work/segmentation.log"
"$segmentation" "${seg[@]}" > "$work/segmentation_plain.log"
"$dcgan" --config "$configs/O1_bf16.ini" --verbosity 0 --steps 200 --report-every 100 \
  --tensorboard "$runs/dcgan" > "$work/dcgan.log"

python3 "$reader" runs "$runs" > "$work/runs.txt"
cat "$work/runs.txt"
fail=0
expect() {  # RUN POINTS FIRST_STEP LAST_STEP TAG...
  local run=$1 n=$2 first=$3 last=$4
  shift 4
  for tag in "$@"; do
    awk -F'\t' -v run="$run" -v tag="$tag" -v n="$n" -v first="$first" -v last="$last" '
      $2 == run && $3 == tag { found = 1
        if ($4 != n || $5 != first || $6 != last) {
          print "FAIL: " run " " tag ": " $4 " points, steps " $5 ".." $6 "; expected " n ", " first ".." last; exit 1 } }
      END { if (!found) { print "FAIL: run " run " has no tag " tag; exit 1 } }' "$work/runs.txt" || fail=1
  done
}

expect train 3 1 3 train_loss val_loss val_acc lr images_per_second amp/loss_scale/0 amp/skipped_steps \
  amp/grad_norm grad_log10_magnitude
# The logged values are the CSV's (TensorBoard keeps float32).
awk -F'\t' 'NR == FNR { if ($2 == "train" && $6 == 3) v[$3] = $7; next }
  FNR == 4 { split("lr train_loss val_loss val_acc amp/loss_scale/0 amp/skipped_steps amp/grad_norm", tags, " ")
             split($2 " " $3 " " $4 " " $5 " " $6 " " $7 " " $10, csv, " ")
             for (i = 1; i <= 7; ++i) { d = v[tags[i]] - csv[i]; if (d < 0) d = -d
               if (!(d <= 1e-6 * (csv[i] < 0 ? -csv[i] : csv[i]) + 1e-12)) { print "FAIL: train " tags[i] " " v[tags[i]] " != CSV " csv[i]; bad = 1 } }
             if (!bad) print "ok: train epoch 3 in TensorBoard equals the CSV" }
  END { exit bad }' "$work/runs.txt" FS=, "$work/train.csv" || fail=1

# Segmentation: one run per configuration that ran (LibTorch 1.13 refuses O2_bf16 on CPU: no run then).
for mode in O0 O2_bf16; do
  if grep -q "^$mode .*skipped:" "$work/segmentation.log"; then
    if grep -q "^run	segmentation/$mode	" "$work/runs.txt"; then echo "FAIL: a run for refused $mode"; fail=1; fi
    continue
  fi
  expect "segmentation/$mode" 4 1 4 train_loss_step
  expect "segmentation/$mode" 2 1 2 train_loss val_loss val_acc val_miou lr seconds_per_epoch amp/loss_scale/0 \
    amp/skipped_steps
done
results() { awk '$1 ~ /^O[0-3]/ { print $1, $2 == "skipped:" ? "skipped" : $5 " " $6 }' "$1"; }
if ! diff <(results "$work/segmentation.log") <(results "$work/segmentation_plain.log"); then
  echo "FAIL: segmentation's final loss or pixel accuracy changed with --tensorboard"; fail=1
fi

expect dcgan 200 1 200 errD errG D_x amp/loss_scale/0 amp/loss_scale/1 amp/loss_scale/2 amp/skipped_steps/D \
  amp/skipped_steps/G
expect dcgan 2 100 200 near_mode modes_covered lr/D lr/G

# An unwritable directory stops the program before training, naming the directory.
echo "not a directory" > "$work/file"
if "$train" --config "$configs/O2_bf16.ini" --epochs 1 --tensorboard "$work/file/run" > /dev/null 2> "$work/error.txt"; then
  echo "FAIL: train accepted an unwritable --tensorboard directory"; fail=1
elif ! grep -q "amp::SummaryWriter: cannot create the log directory '$work/file/run'" "$work/error.txt"; then
  echo "FAIL: unexpected error:"; cat "$work/error.txt"; fail=1
fi

[ "$fail" = 0 ] && echo "ok: train, segmentation and dcgan runs read back by TensorBoard with every tag at every step"
exit "$fail"
