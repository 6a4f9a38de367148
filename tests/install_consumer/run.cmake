# Installs the build at BUILD_DIR into WORK_DIR/prefix, then configures, builds and runs the
# consumer project at SOURCE_DIR against it with the main build's compiler, flags, generator and
# {fmt} (cmake -P; the install_consumer test). An installed CLI looks for the shipped model
# configs in its own share/ first.
file(REMOVE_RECURSE "${WORK_DIR}")
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install_consumer: `${ARGN}` failed (${rc})")
  endif()
endfunction()
step("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
step("${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
     "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
     "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
     "-Dfmt_DIR=${FMT_DIR}")
step("${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
step("${WORK_DIR}/build/consumer")
if(EXISTS "${WORK_DIR}/prefix/bin/meshfuse")
  execute_process(COMMAND "${WORK_DIR}/prefix/bin/meshfuse" bench --model no-such-model
                  ERROR_VARIABLE err OUTPUT_QUIET)
  file(REAL_PATH "${WORK_DIR}/prefix/share/meshfuse/models" models)  # as /proc/self/exe gives it
  string(FIND "${err}" "looked for ${models}/no-such-model.json" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "install_consumer: the installed CLI did not look in its share/ first: "
                        "${err}")
  endif()
endif()
