# Run after each build by amp_gtest_suites (cmake/AmpGTestSuites.cmake): lists EXECUTABLE's suites and writes
# OUTPUT, a ctest file with one add_test per suite (two for a suite in SHARDED), costliest first (LONG suites, then
# shards, then by their number of tests).
execute_process(COMMAND "${EXECUTABLE}" --gtest_list_tests OUTPUT_VARIABLE listing RESULT_VARIABLE rc
                TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "amp: '${EXECUTABLE} --gtest_list_tests' failed (${rc}):\n${listing}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
foreach(line IN LISTS lines)
  # A suite line is unindented, "Suite." or "Prefix/Suite." with an optional "  # TypeParam = ..." after it;
  # its tests follow, indented.
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    list(APPEND suites "${suite}")
    set(count_${suite} 0)
  elseif(line MATCHES "^  [^ ]" AND suite)
    math(EXPR count_${suite} "${count_${suite}} + 1")
  endif()
endforeach()
set(content "# Written by cmake/write_gtest_suites.cmake from '${EXECUTABLE} --gtest_list_tests'.\n")
foreach(suite IN LISTS suites)
  set(filter "--gtest_filter=${suite}.*")
  if(suite IN_LIST SHARDED)
    foreach(shard 0 1)
      math(EXPR number "${shard} + 1")
      set(name "${suite}:${number}/2")
      string(APPEND content "add_test([=[${name}]=] \"${EXECUTABLE}\" [=[${filter}]=])\n"
                            "set_tests_properties([=[${name}]=] PROPERTIES COST 1000 TIMEOUT ${TIMEOUT} ENVIRONMENT "
                            "\"OMP_NUM_THREADS=1;GTEST_TOTAL_SHARDS=2;GTEST_SHARD_INDEX=${shard}\")\n")
    endforeach()
  else()
    set(cost ${count_${suite}})
    if(suite IN_LIST LONG)
      set(cost 1500)
    endif()
    string(APPEND content "add_test([=[${suite}]=] \"${EXECUTABLE}\" [=[${filter}]=])\n"
                          "set_tests_properties([=[${suite}]=] PROPERTIES COST ${cost} TIMEOUT ${TIMEOUT} "
                          "ENVIRONMENT OMP_NUM_THREADS=1)\n")
  endif()
endforeach()
foreach(suite IN LISTS SHARDED LONG)
  if(NOT suite IN_LIST suites)
    message(FATAL_ERROR "amp: SHARDED or LONG names '${suite}', which '${EXECUTABLE}' does not have (its suites: ${suites})")
  endif()
endforeach()
file(WRITE "${OUTPUT}" "${content}")
