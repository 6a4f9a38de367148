// The mpi backend.
#include "dist/comm_impl.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {

std::unique_ptr<CommImpl> make_mpi_comm(const TeamContext&) {
  fail(ErrorCode::BackendUnavailable,
       "communicator backend mpi: not in this build (install libopenmpi-dev and configure with "
       "-DMESHFUSE_MPI=ON)");
}

}  // namespace meshfuse::detail
