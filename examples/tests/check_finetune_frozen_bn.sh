#!/usr/bin/env bash
# Exercises examples/finetune_frozen_bn at each level in bf16: it must fine-tune to well above the 20%
# of chance with the pretrained BatchNorm statistics bit-for-bit unchanged.
#   check_finetune.sh BINARY WORK_DIR CONFIG_DIR
set -euo pipefail
rm -rf "$2" && mkdir -p "$2"
digits_gz=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
[ -f "$digits_gz" ] && gzip -dc "$digits_gz" > "$2/digits.csv"
for config in O0 O1_bf16 O2_bf16 O3_bf16; do
  out=$("$1" --config "$3/$config.ini" --verbosity 0 --data "$2/digits.csv" --pretrained "$2/backbone.pt")
  echo "$out"
  echo "$out" | grep -q "BatchNorm statistics unchanged: yes" || { echo "FAIL: $config changed the statistics"; exit 1; }
  echo "$out" | awk -v c="$config" '/^fine-tuned/ { a = $(NF - 2) + 0; if (a < 80) { print "FAIL: " c " accuracy " a "%"; exit 1 } }'
done
