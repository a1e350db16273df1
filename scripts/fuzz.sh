#!/usr/bin/env bash
# Builds the libFuzzer target over amp's config parser and text inputs, then fuzzes from the seed
# corpus. Arguments go to libFuzzer: scripts/fuzz.sh -runs=1000000   or   scripts/fuzz.sh -max_total_time=60
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
torch_include="$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "include"))')"
cmake -S fuzz -B build/fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DTORCH_INCLUDE="$torch_include" > build/fuzz.configure.log 2>&1 || { cat build/fuzz.configure.log; exit 1; }
cmake --build build/fuzz -j "${AMP_JOBS:-2}" > build/fuzz.build.log 2>&1 || { tail -n 40 build/fuzz.build.log; exit 1; }
mkdir -p build/fuzz/corpus
# New inputs go to build/fuzz/corpus; fuzz/corpus stays the committed seeds.
# -timeout: an input that runs longer than 10 s is a hang, reported and saved as a crash-* file like a
# crash (a flag that sent Boost's message formatting into an endless loop was one); a later -timeout=N
# in "$@" wins.
exec build/fuzz/config_fuzzer -dict=fuzz/config.dict -timeout=10 -print_final_stats=1 "$@" build/fuzz/corpus fuzz/corpus
