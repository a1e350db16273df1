#!/usr/bin/env bash
# Exercises examples/segmentation briefly: every configuration learns (validation loss well under the
# 1.0986 of a uniform guess over 3 classes), O2/O3 hold less memory than O0, and the PNG is drawn.
#   check_segmentation.sh SEGMENTATION_BINARY WORK_DIR
set -euo pipefail
rm -rf "$2" && mkdir -p "$2"
out=$("$1" --epochs 4 --images 256 --modes O0,O1_bf16,O2_bf16,O3_bf16 --plot "$2/loss.png")
echo "$out"
echo "$out" | awk '$1 ~ /^O[0-3]/ && $2 != "skipped:" {
    rows++; mib[$1] = $4 + 0
    if (!($5 < 0.8)) { print "FAIL: " $1 " validation loss " $5; bad = 1 } }
  END { if (rows != 4) { print "FAIL: expected 4 result rows, got " rows; exit 1 }
        if (!(mib["O2_bf16"] < mib["O0"] && mib["O3_bf16"] < mib["O0"])) { print "FAIL: O2/O3 not smaller than O0"; exit 1 }
        if (bad) exit 1; print "ok: 4 configurations learned; peak MiB O0 " mib["O0"] ", O2 " mib["O2_bf16"] }'
if command -v gnuplot > /dev/null; then test -s "$2/loss.png" || { echo "FAIL: no PNG"; exit 1; }; fi
