# Run after each build by amp_gtest_suites (cmake/AmpGTestSuites.cmake): lists EXECUTABLE's suites and writes
# OUTPUT, a ctest file with one add_test per suite.
execute_process(COMMAND "${EXECUTABLE}" --gtest_list_tests OUTPUT_VARIABLE listing RESULT_VARIABLE rc
                TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "amp: '${EXECUTABLE} --gtest_list_tests' failed (${rc}):\n${listing}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(content "# Written by cmake/write_gtest_suites.cmake from '${EXECUTABLE} --gtest_list_tests'.\n")
foreach(line IN LISTS lines)
  # A suite line is unindented, "Suite." or "Prefix/Suite." with an optional "  # TypeParam = ..." after it.
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND content "add_test([=[${suite}]=] \"${EXECUTABLE}\" [=[--gtest_filter=${suite}.*]=])\n"
                          "set_tests_properties([=[${suite}]=] PROPERTIES ENVIRONMENT OMP_NUM_THREADS=1 TIMEOUT ${TIMEOUT})\n")
  endif()
endforeach()
file(WRITE "${OUTPUT}" "${content}")
