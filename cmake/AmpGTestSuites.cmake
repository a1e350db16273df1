# amp_gtest_suites(<target> [TIMEOUT <s>] [SHARDED <suite>...] [LONG <suite>...]): one ctest test per GoogleTest suite of <target>, listed after each
# build (as gtest_discover_tests lists single tests). A test process costs about 0.6 s before its first line
# (loading LibTorch), so a process per test spent some 5 minutes of each CI flavor on starting ~480 processes.
# gtest still reports every test by name, and `ctest -R Suite` / `--gtest_filter` pick one out.
# -DAMP_CTEST_PER_TEST=ON registers every test on its own instead (scripts/gpu-check.sh: many cores).
# TIMEOUT (default 600 s, about 3x the slowest suite seen, 210 s on 2 shared cores) fails a hung suite fast, by name.
# SHARDED <suite>...: suites that take minutes (they call Python for each test) run as two ctest tests, each with
# half of the suite's tests (GoogleTest's GTEST_TOTAL_SHARDS), named "<suite>:1/2" and "<suite>:2/2". ctest starts
# the costliest tests first (COST: 1000 for a shard, else the suite's number of tests), so no long suite is left to
# run alone on one core at the end of `ctest -j 2`.
# LONG <suite>...: suites that take half a minute or more in one process (training-quality figures, ranks): COST 1500,
# so a cold ctest (no timings of an earlier run yet, as in CI) starts them first too.
option(AMP_CTEST_PER_TEST "One ctest test per GoogleTest test instead of per suite" OFF)
include(GoogleTest)

function(amp_gtest_suites target)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SHARDED;LONG" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 600)
  endif()
  if(AMP_CTEST_PER_TEST)
    gtest_discover_tests(${target} DISCOVERY_TIMEOUT 120
      PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=1" SKIP_REGULAR_EXPRESSION "SKIPPED" TIMEOUT ${ARG_TIMEOUT})
    return()
  endif()
  set(suites "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake")
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -DEXECUTABLE=$<TARGET_FILE:${target}> -DOUTPUT=${suites} -DTIMEOUT=${ARG_TIMEOUT}
            "-DSHARDED=${ARG_SHARDED}" "-DLONG=${ARG_LONG}" -P ${PROJECT_SOURCE_DIR}/cmake/write_gtest_suites.cmake
    BYPRODUCTS ${suites} VERBATIM)
  # ctest reads the list when it runs; before the first build there is none, and ctest says so.
  file(WRITE "${include_file}"
       "if(EXISTS \"${suites}\")\n  include(\"${suites}\")\nelse()\n"
       "  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()
