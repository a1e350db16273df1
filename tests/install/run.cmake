# Builds a consumer with find_package(amp) twice: against amp installed into a temporary prefix, and
# against the build tree itself (amp_DIR=<build dir>, the exported ampTargets.cmake).
file(REMOVE_RECURSE ${WORK_DIR})
string(REPLACE "|" ";" consumer_args "${CONSUMER_ARGS}")  # "|-Da=1|-Db=2", joined so the test command keeps it whole

# Configures, builds and runs the consumer in ${WORK_DIR}/${label}; the extra arguments locate amp.
function(consume label)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${AMP_SOURCE_DIR}/tests/install/consumer -B ${WORK_DIR}/${label}
                    ${ARGN} ${consumer_args} -DTorch_DIR=${TORCH_DIR}
                    -DCMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${label}: configuring the consumer failed")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/${label} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${label}: building the consumer failed")
  endif()
  execute_process(COMMAND ${WORK_DIR}/${label}/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "O2 loss scale 65536.0")
    message(FATAL_ERROR "${label}: the consumer failed (rc=${rc}): ${out}")
  endif()
  message(STATUS "${label} consumer: ${out}")
endfunction()

execute_process(COMMAND ${CMAKE_COMMAND} --install ${AMP_BINARY_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed")
endif()
consume(installed -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
# The build tree's package: no install step, and nothing else on the search path to fall back to.
consume(build-tree -Damp_DIR=${AMP_BINARY_DIR} -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
