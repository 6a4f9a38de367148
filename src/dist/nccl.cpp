// The nccl backend. A placeholder until the NCCL implementation lands: this build has no nccl.
#include "dist/comm_impl.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {

std::unique_ptr<CommImpl> make_nccl_comm(const TeamContext&) {
  fail(ErrorCode::BackendUnavailable, "communicator backend nccl: not built in this build");
}

}  // namespace meshfuse::detail
