#!/usr/bin/env bash
# Builds amp's libFuzzer targets, then fuzzes one from its seed corpus. Arguments after the target go to
# libFuzzer:
#   scripts/fuzz.sh [config] -max_total_time=60   # config files, command lines, opt levels, loss scales
#   scripts/fuzz.sh pickle -runs=1000000          # the pickle reader of Python checkpoints (src/interop/pickle.h)
set -euo pipefail
cd "$(dirname "$0")/.."
target=config
case "${1:-}" in config|pickle) target=$1; shift ;; esac
mkdir -p build
torch_site="$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
cmake -S fuzz -B build/fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DTORCH_INCLUDE="$torch_site/include" -DTORCH_LIB="$torch_site/lib" > build/fuzz.configure.log 2>&1 ||
  { cat build/fuzz.configure.log; exit 1; }
cmake --build build/fuzz -j "${AMP_JOBS:-2}" --target "${target}_fuzzer" > build/fuzz.build.log 2>&1 ||
  { tail -n 40 build/fuzz.build.log; exit 1; }
mkdir -p "build/fuzz/${target}_corpus"
# New inputs go to build/fuzz/<target>_corpus; fuzz/corpus (config) and fuzz/pickle_corpus stay the committed seeds.
# -timeout: an input that runs longer than 10 s is a hang, reported and saved as a crash-* file like a crash (a
# flag that sent Boost's message formatting into an endless loop was one); -rss_limit_mb: an input that makes
# the reader allocate without bound is a finding too. A later -timeout=N in "$@" wins.
if [ "$target" = config ]; then
  exec build/fuzz/config_fuzzer -dict=fuzz/config.dict -timeout=10 -print_final_stats=1 "$@" build/fuzz/config_corpus fuzz/corpus
fi
exec build/fuzz/pickle_fuzzer -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$@" build/fuzz/pickle_corpus fuzz/pickle_corpus
