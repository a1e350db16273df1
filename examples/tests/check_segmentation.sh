#!/usr/bin/env bash
# Exercises examples/segmentation briefly: every configuration learns (validation loss well under the
# 1.0986 of a uniform guess over 3 classes), the Apex-style levels and the torch.amp loop (autocast +
# GradScaler) alike, O1-O3 and autocast hold less memory than O0, and the PNG is drawn.
#   check_segmentation.sh SEGMENTATION_BINARY WORK_DIR
set -euo pipefail
rm -rf "$2" && mkdir -p "$2"
out=$("$1" --epochs 4 --images 256 --modes O0,O1_bf16,O2_bf16,O3_bf16,autocast_bf16 --plot "$2/loss.png")
echo "$out"
# A configuration amp::initialize refuses (a layer this LibTorch can't run in that dtype, e.g. 1.13's CPU
# bfloat16 transposed convolution) is a pass with its reason printed; anything else must learn.
echo "$out" | awk '$1 ~ /^(O[0-3]|autocast_)/ {
    if ($2 == "skipped:") { if ($0 !~ /amp::initialize/) { print "FAIL: " $0; bad = 1 } else refused++; next }
    ran++; mib[$1] = $4 + 0
    if (!($5 < 0.8)) { print "FAIL: " $1 " validation loss " $5; bad = 1 } }
  END { if (ran + refused != 5 || !("O0" in mib) || !("O1_bf16" in mib)) { print "FAIL: rows ran " ran ", refused " refused; exit 1 }
        for (m in mib) if (m != "O0" && !(mib[m] < mib["O0"])) { print "FAIL: " m " holds no less memory than O0"; bad = 1 }
        if (bad) exit 1; print "ok: " ran " configurations learned, " refused " refused by amp::initialize" }'
if command -v gnuplot > /dev/null; then test -s "$2/loss.png" || { echo "FAIL: no PNG"; exit 1; }; fi
