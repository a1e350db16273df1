#!/usr/bin/env bash
# The whole test suite: sets up, then builds and tests amp against LibTorch 2.13 (the wheel's), the CUDA 13.0
# build of LibTorch 2.13 (PyPI's default wheel in a venv, scripts/setup-cuda.sh: the library and tests compiled
# and linked with CUDA on, the suite run on the CPU but for its Python comparisons, CUDA variants skipped with the
# reason), 1.13 (Debian's) and 2.13
# under AddressSanitizer + UndefinedBehaviorSanitizer, runs the long soak once and fuzzes the config parser
# and the pickle reader for 30 s each. Tests that need fp16 CPU kernels skip on 1.13 and print why.
#   scripts/test.sh                 # everything (what CI runs)
#   scripts/test.sh 2.13 [cuda ...] # just these builds
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
./scripts/setup.sh
versions=("$@")
full=0
[ ${#versions[@]} -gt 0 ] || { versions=(2.13 cuda 1.13 2.13-sanitize); full=1; }
status=0
# The CUDA wheels (~2.6 GB) download while the first flavors compile: the network, not the cores, is their limit.
# It runs in a session of its own (setsid), so that a failing build stops it with its pip children rather than
# leaving it downloading after the run; setup-cuda.sh bounds it by 20 minutes itself.
cuda_setup=""
if [[ " ${versions[*]} " == *" cuda "* ]]; then
  setsid ./scripts/setup-cuda.sh > build/setup-cuda.log 2>&1 < /dev/null &
  cuda_setup=$!
  trap '[ -z "$cuda_setup" ] || kill -- "-$cuda_setup" 2> /dev/null || true' EXIT
fi
for version in "${versions[@]}"; do
  if [ "$version" = cuda ] && [ -n "$cuda_setup" ]; then
    wait "$cuda_setup" || { cat build/setup-cuda.log; exit 1; }
    cuda_setup=""
  fi
  echo "=== LibTorch $version: build"
  start=$(date +%s)
  ./scripts/build.sh "$version" > "build/torch-$version.build.log" 2>&1 || { tail -n 80 "build/torch-$version.build.log"; exit 1; }
  built=$(date +%s)
  echo "=== LibTorch $version: built in $((built - start)) s; testing"
  # One ctest test per GoogleTest suite (cmake/AmpGTestSuites.cmake). Without a GPU the cuda flavor leaves out
  # the suites that compare with Python torch on the CPU: the 2.13 flavor runs them on the same CPU kernels.
  exclude=()
  if [ "$version" = cuda ] && ! "$(./scripts/setup-cuda.sh)/bin/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    exclude=(-E '^(Cases/PythonRoundTripTest|Cases/PlainOptimizerRoundTripTest|PythonCheckpointTest|PickleTest|TensorBoardTest|TorchScriptTest|Fp8TorchScriptTest|Cases/Fp8GemmTest|Cases/Fp8TrainingTest|SoakTest|StateFormatReferenceTest|StateFormatPythonTest|Fp8RecipeQuantizationTest|Cases/Fp8RecipeGemmTest|Cases/Fp8RecipeTrainingTest|Fp8RecipeTorchScriptTest)(:[12]/2)?$')
  fi
  # The sanitizer build is not installed for consumers: its install check would only repeat the 2.13 one.
  [ "$version" = 2.13-sanitize ] && exclude=(-E '^install_and_consume$')
  # Leak checking stays on under the sanitizers; LibTorch's own one-time registrations are not reported.
  if ! (cd "build/torch-$version" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 OMP_NUM_THREADS=1 \
        ctest --output-on-failure -j 2 --timeout 600 -LE long "${exclude[@]}"); then status=1; fi
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
if [ $full = 1 ]; then
  for target in config pickle; do
    echo "=== fuzzing the $target reader for 30 s"
    # A crash, or a fuzzer that fails to build, prints its log's tail: the exit status alone says nothing.
    if ./scripts/fuzz.sh "$target" -max_total_time=30 > "build/fuzz-$target.log" 2>&1; then
      grep -E "stat::number_of_executed_units|Done" "build/fuzz-$target.log"
    else
      tail -n 40 "build/fuzz-$target.log"; status=1
    fi
  done
fi
exit $status
