// The gloo backend.
#include "dist/comm_impl.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {

std::unique_ptr<CommImpl> make_gloo_comm(const TeamContext&) {
  fail(ErrorCode::BackendUnavailable,
       "communicator backend gloo: not in this build (install libgloo-dev and configure with "
       "-DMESHFUSE_GLOO=ON)");
}

}  // namespace meshfuse::detail
