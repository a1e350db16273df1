#!/usr/bin/env bash
# The whole test suite: sets up, then builds and tests amp against LibTorch 2.13 (the wheel's), 1.13 (Debian's), 2.13
# under AddressSanitizer + UndefinedBehaviorSanitizer, and the CUDA 13.0 build of LibTorch 2.13 (PyPI's default wheel
# in a venv, scripts/setup-cuda.sh: without a GPU that flavor compiles and links the library, the CUDA tests and the
# install check with CUDA on, and runs the CUDA tests, which skip with the reason; every other test is the same code
# the 2.13 flavor runs). Beside the flavors, the long soak and 30 s of fuzzing for each of the config parser and the
# pickle reader run at low priority, on the core a flavor leaves idle. Tests that need fp16 CPU kernels skip on 1.13
# and print why. At the end a table says how long each stage took.
#   scripts/test.sh                 # everything (what CI runs)
#   scripts/test.sh 2.13 [cuda ...] # just these builds
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
run_start=$(date +%s)
versions=("$@")
full=0
[ ${#versions[@]} -gt 0 ] || { versions=(2.13 1.13 2.13-sanitize cuda); full=1; }
status=0

# The stage table: one row per stage (name, seconds, outcome). Background stages write their row to a file when they
# end; the table is printed however the run ends.
stages=build/test-stages.tsv
: > "$stages"
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$stages"; }
stage() {  # stage NAME COMMAND...: runs the command as one row of the table
  local name=$1 start rc=0
  shift
  start=$(date +%s)
  "$@" || rc=$?
  record "$name" $(( $(date +%s) - start )) "$([ $rc = 0 ] && echo ok || echo "FAILED ($rc)")"
  return $rc
}
print_table() {
  echo "=== stages (wall seconds; background stages overlap the others)"
  printf '%-44s %8s  %s\n' stage seconds outcome
  while IFS=$'\t' read -r name secs outcome; do printf '%-44s %8s  %s\n' "$name" "$secs" "$outcome"; done < "$stages"
  printf '%-44s %8s\n' "total" $(( $(date +%s) - run_start ))
}

background=()  # pids of the background stages (their own process groups, killed if the run stops early)
cleanup() {
  for pid in "${background[@]}"; do kill -- "-$pid" 2> /dev/null || true; done
  print_table
}
trap cleanup EXIT

stage "set-up (apt, pip)" ./scripts/setup.sh

# The CUDA wheels (~2.6 GB) download while the other flavors compile: the network, not the cores, is their limit.
# setup-cuda.sh bounds it by 20 minutes itself.
if [[ " ${versions[*]} " == *" cuda "* ]]; then
  setsid bash -c 'start=$(date +%s); rc=0; ./scripts/setup-cuda.sh > build/setup-cuda.log 2>&1 < /dev/null || rc=$?
                  printf "%s\t%s\t%s\n" "cuda set-up (venv, in the background)" $(( $(date +%s) - start )) \
                    "$([ $rc = 0 ] && echo ok || echo "FAILED ($rc)")" >> '"$stages"'; exit $rc' &
  cuda_setup=$!
  background+=("$cuda_setup")
fi

# A background stage at low priority: it takes the cores the foreground leaves idle, under its own time limit.
background_stage() {  # background_stage NAME LIMIT_S LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  setsid nice -n 15 bash -c 'name=$1 limit=$2 log=$3 stages=$4; shift 4; start=$(date +%s); rc=0
    timeout "$limit" "$@" > "$log" 2>&1 < /dev/null || rc=$?
    outcome=ok; [ $rc = 0 ] || outcome="FAILED ($rc$([ $rc = 124 ] && echo ": past its ${limit} s"))"
    printf "%s\t%s\t%s\n" "$name" $(( $(date +%s) - start )) "$outcome" >> "$stages"; exit $rc' \
    _ "$name" "$limit" "$log" "$stages" "$@" &
  background+=("$!")
}

test_flavor() {  # test_flavor VERSION: ctest, then why each skipped test skipped
  local version=$1 exclude=() rc=0
  # The sanitizer build is not installed for consumers: its install check would only repeat the 2.13 one.
  [ "$version" = 2.13-sanitize ] && exclude=(-E '^install_and_consume$')
  # The ZeRO suites' 4-rank runs (4 processes on 2 cores, the suites' longest part; 4 ranks' slice ends and reordering
  # bounds) run in the 2.13 flavor; the sanitizer and 1.13 flavors run the 2-rank half (tests/parallel_test.cpp).
  local max_ranks=4
  case "$version" in 1.13|2.13-sanitize) max_ranks=2 ;; esac
  # Leak checking stays on under the sanitizers; LibTorch's own one-time registrations are not reported.
  (cd "build/torch-$version" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 OMP_NUM_THREADS=1 \
     AMP_TEST_MAX_RANKS=$max_ranks ctest --output-on-failure -j 2 --timeout 600 -LE long "${exclude[@]}") || rc=$?
  [ $max_ranks = 4 ] || echo "    left out: the ZeRO suites' 4-rank runs (AMP_TEST_MAX_RANKS=2; the 2.13 flavor runs them)"
  # Say why each skipped test skipped (the GTEST_SKIP message follows gtest's "Skipped" line).
  awk '/: Skipped$/ { getline reason; next_reason = reason }
       /\[  SKIPPED \]/ && next_reason != "" { sub(/.*SKIPPED \] /, ""); sub(/ \(.*/, "");
                                             print "    skipped " $0 ": " next_reason; next_reason = "" }' \
      "build/torch-$version/Testing/Temporary/LastTest.log" | sort -u
  return $rc
}

build_flavor() {  # build_flavor VERSION: its log's tail on failure
  ./scripts/build.sh "$1" > "build/torch-$1.build.log" 2>&1 || { tail -n 80 "build/torch-$1.build.log"; return 1; }
}

for version in "${versions[@]}"; do
  if [ "$version" = cuda ] && [ -n "${cuda_setup:-}" ]; then
    wait "$cuda_setup" || { cat build/setup-cuda.log; exit 1; }
    cuda_setup=""
  fi
  echo "=== LibTorch $version: build"
  stage "LibTorch $version: build" build_flavor "$version" || exit 1
  echo "=== LibTorch $version: test"
  stage "LibTorch $version: test" test_flavor "$version" || status=1
  if [ "$version" = 2.13 ] && [ $full = 1 ]; then
    # The long soak (60 000 steps, one core) and the fuzzers (a clang build, then 30 s each) in the background from
    # here on, at low priority: they fill the gaps of the flavors that follow.
    background_stage "soak, 60 000 steps (background)" 900 build/soak.log \
      bash -c 'cd build/torch-2.13 && ctest --output-on-failure -V -L long'
    background_stage "fuzz: config + pickle readers, 30 s each (background)" 900 build/fuzz.log \
      bash -c './scripts/fuzz.sh config -max_total_time=30 && ./scripts/fuzz.sh pickle -max_total_time=30'
  fi
done

# The background stages' outcomes: the soak's counts, the fuzzers' statistics, or the tail of what failed.
for pid in "${background[@]}"; do
  wait "$pid" || status=1
done
background=()
if [ $full = 1 ]; then
  grep -E "soak:|tests passed|Failed" build/soak.log || { tail -n 40 build/soak.log; status=1; }
  # A crash, or a fuzzer that fails to build, prints its log's tail: the exit status alone says nothing.
  grep -E "stat::number_of_executed_units|Done" build/fuzz.log || { tail -n 40 build/fuzz.log; status=1; }
  grep -q "FAILED" "$stages" && status=1
fi
exit $status
