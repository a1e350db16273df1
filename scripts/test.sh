#!/usr/bin/env bash
# The whole test suite: sets up, then builds and tests amp against LibTorch 2.13 (the wheel's) and
# 1.13 (Debian's). Tests that need fp16 CPU kernels skip on 1.13 and print why.
#   scripts/test.sh            # both versions
#   scripts/test.sh 2.13       # one version
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
./scripts/setup.sh
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.13 1.13)
status=0
for version in "${versions[@]}"; do
  echo "=== LibTorch $version: build"
  start=$(date +%s)
  ./scripts/build.sh "$version" > "build/torch-$version.build.log" 2>&1 || { tail -n 80 "build/torch-$version.build.log"; exit 1; }
  built=$(date +%s)
  echo "=== LibTorch $version: built in $((built - start)) s; testing"
  if ! (cd "build/torch-$version" && OMP_NUM_THREADS=1 ctest --output-on-failure -j 2 --timeout 900 -LE long); then status=1; fi
  if [ "$version" = 2.13 ]; then  # long modes, once
    (cd "build/torch-$version" && ctest --output-on-failure -V -L long | grep -E "soak:|tests passed|Failed") || status=1
  fi
  # Say why each skipped test skipped (the GTEST_SKIP message follows gtest's "Skipped" line).
  awk '/: Skipped$/ { getline reason; next_reason = reason }
       /\[  SKIPPED \]/ && next_reason != "" { sub(/.*SKIPPED \] /, ""); sub(/ \(.*/, "");
                                             print "    skipped " $0 ": " next_reason; next_reason = "" }' \
      "build/torch-$version/Testing/Temporary/LastTest.log" | sort -u
  echo "=== LibTorch $version: tests took $(( $(date +%s) - built )) s"
done
exit $status
