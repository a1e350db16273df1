#!/usr/bin/env bash
# Exercises examples/finetune_torchscript: Python scripts and pretrains the model, C++ fine-tunes it at each level
# in bf16 (well above the 20% of chance, BatchNorm statistics bit-for-bit unchanged) and saves it, and Python's
# torch.jit.load runs the saved module with fp32 weights to the accuracy C++ measured (exit 77: no Python torch).
#   check_finetune_torchscript.sh BINARY WORK_DIR CONFIG_DIR
set -euo pipefail
python=${AMP_PYTHON:-python3}
"$python" -c 'import torch' 2> /dev/null || { echo "skipped: needs Python with the torch wheel"; exit 77; }
here=$(cd "$(dirname "$0")/../finetune_torchscript" && pwd)
rm -rf "$2" && mkdir -p "$2"
digits_gz=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
[ -f "$digits_gz" ] || { echo "skipped: needs python3-sklearn's digits.csv.gz"; exit 77; }
gzip -dc "$digits_gz" > "$2/digits.csv"
"$python" -W ignore "$here/pretrain.py" "$2/digits.csv" "$2/pretrained.pt"
for config in O0 O1_bf16 O2_bf16 O3_bf16; do
  out=$("$1" --config "$3/$config.ini" --verbosity 0 --data "$2/digits.csv" --model "$2/pretrained.pt" \
             --out "$2/finetuned_$config.pt")
  echo "$out"
  echo "$out" | grep -q "BatchNorm statistics unchanged: yes" || { echo "FAIL: $config changed the statistics"; exit 1; }
  cpp=$(echo "$out" | awk '/^fine-tuned/ { print $(NF - 2) + 0 }')
  awk -v a="$cpp" -v c="$config" 'BEGIN { if (a < 80) { print "FAIL: " c " accuracy " a "%"; exit 1 } }'
  py_out=$(cd "$here" && "$python" -W ignore evaluate.py "$2/digits.csv" "$2/finetuned_$config.pt")
  echo "$py_out"
  py=$(echo "$py_out" | awk '{ for (i = 1; i <= NF; ++i) if ($i ~ /%$/) print $i + 0 }')
  # C++ evaluated in the level's precision, Python in fp32: the same weights, within a few images.
  awk -v a="$cpp" -v b="$py" -v c="$config" 'BEGIN { d = a - b; if (d < 0) d = -d;
      if (d > 2) { print "FAIL: " c ": C++ " a "% but Python " b "%"; exit 1 } }'
done
