#!/usr/bin/env bash
# Exercises examples/train with short settings: it must learn (accuracy far above the 10% of chance,
# loss falling), a run stopped after epoch 2 and resumed must continue bitwise like the run that never
# stopped, and a run with --fused true must equal the plain one (every metric but wall time equal to the
# last printed digit); --optimizer muon (FusedMuon + FusedAdamW on one loss) learns and resumes bitwise too.
#   check_train.sh TRAIN_BINARY WORK_DIR CONFIG
set -euo pipefail
train=$1 work=$2 config=$3
rm -rf "$work" && mkdir -p "$work"
digits_gz=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
data="$work/digits.csv"
[ -f "$digits_gz" ] && gzip -dc "$digits_gz" > "$data"
common=(--config "$config" --data "$data" --verbosity 0 --seed 3)

"$train" "${common[@]}" --epochs 4 --checkpoint "$work/a.pt" --metrics "$work/a.csv" > "$work/a.log"
"$train" "${common[@]}" --epochs 2 --checkpoint "$work/b.pt" --metrics "$work/b.csv" > "$work/b.log"
"$train" "${common[@]}" --epochs 4 --checkpoint "$work/b.pt" --metrics "$work/b.csv" --resume true > "$work/b2.log"
# amp::optim::FusedSGD steps bitwise like torch::optim::SGD, and at O2 it writes the model's bf16 copy with
# the same rounding as amp's copy pass: the whole run must be identical.
"$train" "${common[@]}" --epochs 4 --metrics "$work/f.csv" --fused true > "$work/f.log"
# --clip-grad-norm: amp::clip_grad_norm_ on the gradients the step uses; still learns, logs the mean norm.
"$train" "${common[@]}" --epochs 4 --metrics "$work/c.csv" --clip-grad-norm 0.5 > "$work/c.log"
if bad=$("$train" "${common[@]}" --epochs 1 --clip-grad-norm -1 2>&1); then
  echo "FAIL: --clip-grad-norm -1 was accepted"; exit 1
fi
echo "$bad" | grep -q -- "--clip-grad-norm must be positive (or 0: no clipping), got -1" ||
  { echo "FAIL: --clip-grad-norm -1 gave: $bad"; exit 1; }
# --optimizer muon (here from the config file: optimizer = muon): FusedMuon + FusedAdamW on one loss learns, and a
# run stopped after epoch 2 resumes bitwise (both optimizers' state in the checkpoint).
{ cat "$config"; echo "optimizer = muon"; } > "$work/muon.ini"
muon=(--config "$work/muon.ini" --data "$data" --verbosity 0 --seed 3)
"$train" "${muon[@]}" --epochs 4 --metrics "$work/m.csv" > "$work/m.log"
"$train" "${muon[@]}" --epochs 2 --checkpoint "$work/m2.pt" --metrics "$work/m2.csv" > /dev/null
"$train" "${muon[@]}" --epochs 4 --checkpoint "$work/m2.pt" --metrics "$work/m2.csv" --resume true > /dev/null
for flags in "--optimizer adam" "--fused true" "--clip-grad-norm 0.5"; do
  # shellcheck disable=SC2086
  if bad=$("$train" "${muon[@]}" --epochs 1 $flags 2>&1); then echo "FAIL: muon with $flags was accepted"; exit 1; fi
  case "$flags" in
    "--optimizer adam") want="--optimizer must be sgd, fused_sgd or muon, got 'adam'" ;;
    "--fused true") want="--fused true steps FusedSGD, and --optimizer muon asks for another; give one of them" ;;
    *) want="Leave --clip-grad-norm 0 with muon" ;;
  esac
  echo "$bad" | grep -qF -- "$want" || { echo "FAIL: muon with $flags gave: $bad"; exit 1; }
done
cat "$work/a.log"

strip_time() { cut -d, -f1-7 "$1"; }
if ! diff <(strip_time "$work/a.csv") <(strip_time "$work/b.csv"); then
  echo "FAIL: the resumed run differs from the uninterrupted one"; exit 1
fi
if ! diff <(strip_time "$work/a.csv") <(strip_time "$work/f.csv"); then
  echo "FAIL: the run with --fused true differs from the one with torch::optim::SGD"; exit 1
fi
awk -F, 'NR == 2 { first = $3 } NR == 5 { last = $3; acc = $5 }
         END { if (!(acc > 0.8)) { print "FAIL: validation accuracy " acc " <= 0.8"; exit 1 }
               if (!(last < first * 0.5)) { print "FAIL: train loss " first " -> " last " did not halve"; exit 1 }
               print "ok: accuracy " acc ", train loss " first " -> " last ", resume and --fused bitwise" }' "$work/a.csv"
awk -F, 'NR == 5 { acc = $5; norm = $10 }
         END { if (!(acc > 0.8)) { print "FAIL: with --clip-grad-norm 0.5, validation accuracy " acc " <= 0.8"; exit 1 }
               if (!(norm > 0)) { print "FAIL: with --clip-grad-norm 0.5, mean gradient norm " norm; exit 1 }
               print "ok: with --clip-grad-norm 0.5, accuracy " acc ", mean gradient norm before clipping " norm }' "$work/c.csv"
if diff -q <(strip_time "$work/a.csv") <(strip_time "$work/c.csv") > /dev/null; then
  echo "FAIL: --clip-grad-norm 0.5 changed nothing (the gradients were never clipped)"; exit 1
fi
awk -F, 'NR == 2 { first = $3 } NR == 5 { last = $3; acc = $5 }
         END { if (!(acc > 0.8)) { print "FAIL: with --optimizer muon, validation accuracy " acc " <= 0.8"; exit 1 }
               if (!(last < first * 0.5)) { print "FAIL: with --optimizer muon, train loss " first " -> " last; exit 1 }
               print "ok: with --optimizer muon, accuracy " acc ", train loss " first " -> " last }' "$work/m.csv"
if ! diff <(strip_time "$work/m.csv") <(strip_time "$work/m2.csv"); then
  echo "FAIL: the resumed muon run differs from the uninterrupted one"; exit 1
fi
