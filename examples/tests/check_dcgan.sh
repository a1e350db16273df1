#!/usr/bin/env bash
# Exercises examples/dcgan briefly: the generator must move most of its samples onto the ring's modes
# (from 0% at the start) while the three loss scalers stay finite and positive.
#   check_dcgan.sh DCGAN_BINARY CONFIG
set -euo pipefail
out=$("$1" --config "$2" --verbosity 0 --steps 1500 --report-every 1500)
echo "$out"
echo "$out" | awk '$1 == 1500 {
  found = 1; near = $5 + 0; modes = $6 + 0
  if (near < 20) { print "FAIL: only " near "% of samples near a mode"; exit 1 }
  if (modes < 6) { print "FAIL: only " modes " of 8 modes covered"; exit 1 }
  for (i = 7; i <= 9; ++i) if (!($i > 0)) { print "FAIL: loss scale " $i; exit 1 }
  print "ok: " near "% of samples near a mode, " modes " of 8 modes covered" }
  END { if (!found) { print "FAIL: no line for step 1500"; exit 1 } }'
