#!/usr/bin/env bash
# Runs every benchmark (C++ and Python) and writes bench/results/<date>.md and .csv:
#   bench/run.sh        # 7 repetitions per measurement, OMP_NUM_THREADS=1 unless set
#   bench/run.sh 9      # 9 repetitions
# and appends ZeRO's table (bench/zero.sh) to the report.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-7}
./scripts/setup.sh > /dev/null
mkdir -p build bench/results
./scripts/build.sh 2.13 > build/bench-build.log 2>&1 || { tail -n 40 build/bench-build.log; exit 1; }
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
stamp=$(date +%Y-%m-%d)
build/torch-2.13/bench/amp_bench --reps "$reps" --csv build/bench-cpp.csv > build/bench-cpp.md
# C++ and Python in alternating processes (3 rounds): the Python rows the report compares with, and its own table.
python3 bench/versus_python.py build/torch-2.13/bench/amp_bench --rounds 3 --reps "$reps" --csv build/bench-python.csv \
  >> build/bench-cpp.md
python3 bench/report.py build/bench-cpp.csv build/bench-python.csv build/bench-cpp.md \
  "bench/results/$stamp.md" "bench/results/$stamp.csv"
# ZeRO's byte table and step times on 4 Gloo ranks (bench/zero.sh), appended to the report.
{ echo; echo "## ZeRO (bench/zero.sh 4)"; echo; ./bench/zero.sh 4; } >> "bench/results/$stamp.md"
echo "wrote bench/results/$stamp.md and .csv"
