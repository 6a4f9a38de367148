# Installs the build at BUILD_DIR into WORK_DIR/prefix, then configures, builds and runs the
# consumer project at SOURCE_DIR against it (cmake -P; the install_consumer test). An installed CLI
# looks for the shipped model configs in its own share/ first.
file(REMOVE_RECURSE "${WORK_DIR}")
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install_consumer: `${ARGN}` failed (${rc})")
  endif()
endfunction()
step("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
step("${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
     "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
step("${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
step("${WORK_DIR}/build/consumer")
if(EXISTS "${WORK_DIR}/prefix/bin/meshfuse")
  execute_process(COMMAND "${WORK_DIR}/prefix/bin/meshfuse" bench --model no-such-model
                  ERROR_VARIABLE err OUTPUT_QUIET)
  string(FIND "${err}" "looked for ${WORK_DIR}/prefix/share/meshfuse/models/no-such-model.json"
         at)
  if(at EQUAL -1)
    message(FATAL_ERROR "install_consumer: the installed CLI did not look in its share/ first: "
                        "${err}")
  endif()
endif()
