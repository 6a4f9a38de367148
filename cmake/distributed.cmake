# Communicator backends that need a library: gloo (Debian's libgloo-dev) and mpi (Open MPI), each
# AUTO (when found), ON or OFF. Without them the library still builds and the backend reports
# BackendUnavailable.
set(MESHFUSE_GLOO AUTO CACHE STRING "Build the gloo communicator backend: AUTO (if Gloo is found), ON or OFF")
set_property(CACHE MESHFUSE_GLOO PROPERTY STRINGS AUTO ON OFF)
set(MESHFUSE_MPI AUTO CACHE STRING "Build the mpi communicator backend: AUTO (if MPI is found), ON or OFF")
set_property(CACHE MESHFUSE_MPI PROPERTY STRINGS AUTO ON OFF)

find_package(Threads REQUIRED)
# libcrypto: the TcpStore's handshake (HMAC-SHA256 of the job's secret, random nonces).
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
target_link_libraries(meshfuse PRIVATE Threads::Threads OpenSSL::Crypto)

set(MESHFUSE_WITH_GLOO OFF)
if(NOT MESHFUSE_GLOO STREQUAL "OFF")
  find_package(Gloo QUIET)
  if(Gloo_FOUND)
    target_link_libraries(meshfuse PRIVATE gloo)
    target_compile_definitions(meshfuse PRIVATE MESHFUSE_WITH_GLOO=1)
    set(MESHFUSE_WITH_GLOO ON)
  elseif(MESHFUSE_GLOO STREQUAL "ON")
    message(FATAL_ERROR "MESHFUSE_GLOO=ON but Gloo was not found (Debian: libgloo-dev)")
  endif()
endif()
message(STATUS "meshfuse: gloo communicator ${MESHFUSE_WITH_GLOO}")

set(MESHFUSE_WITH_MPI OFF)
if(NOT MESHFUSE_MPI STREQUAL "OFF")
  # The C API through the CXX component (the project enables no C compiler), without the
  # deprecated C++ bindings.
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    target_link_libraries(meshfuse PRIVATE MPI::MPI_CXX)
    target_compile_definitions(meshfuse PRIVATE MESHFUSE_WITH_MPI=1)
    set(MESHFUSE_WITH_MPI ON)
  elseif(MESHFUSE_MPI STREQUAL "ON")
    message(FATAL_ERROR "MESHFUSE_MPI=ON but MPI was not found (Debian: libopenmpi-dev openmpi-bin)")
  endif()
endif()
message(STATUS "meshfuse: mpi communicator ${MESHFUSE_WITH_MPI}")
