#!/usr/bin/env bash
# ZeRO's byte table and step times (docs/distributed.md): amp_parallel_worker zero_bench on N Gloo ranks over
# 127.0.0.1 (default 4), one thread each. Prints rank 0's table and the CPU it ran on.
#   bench/zero.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-4}
worker=build/torch-2.13/tests/amp_parallel_worker
[ -x "$worker" ] || ./scripts/build.sh 2.13 > build/zero-bench-build.log 2>&1
port=$((29700 + RANDOM % 200))
logs=$(mktemp -d)
for ((r = 0; r < ranks; ++r)); do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
    AMP_TEST_TIMEOUT_S=300 "$worker" zero_bench > "$logs/rank$r.log" 2>&1 &
done
wait
grep -v '^\[rank' "$logs/rank0.log"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores; flags: $(grep -m1 -o -w 'avx512_bf16\|avx512_fp16\|avx512f\|avx2' /proc/cpuinfo | sort -u | xargs)"
rm -rf "$logs"
