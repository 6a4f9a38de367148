// The names of backends, reduce ops and operations (to_string, parse_*), the backends this build
// has and the device types each serves.
#include "core/names.h"

#include <string>
#include <vector>

#include "meshfuse/core/error.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse {

namespace {

constexpr CommunicatorBackend kBackends[] = {CommunicatorBackend::Local, CommunicatorBackend::Gloo,
                                             CommunicatorBackend::Mpi, CommunicatorBackend::Nccl};
constexpr ReduceOp kReduceOps[] = {ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max,
                                   ReduceOp::Avg};
constexpr CommOp kCommOps[] = {CommOp::AllGather, CommOp::ReduceScatter, CommOp::AllReduce,
                               CommOp::Broadcast, CommOp::Reduce,        CommOp::Gather,
                               CommOp::Scatter,   CommOp::AllToAll,      CommOp::Send,
                               CommOp::Recv,      CommOp::SendRecv,      CommOp::Barrier};

}  // namespace

std::string_view to_string(CommunicatorBackend backend) {
  switch (backend) {
    case CommunicatorBackend::Local:
      return "local";
    case CommunicatorBackend::Gloo:
      return "gloo";
    case CommunicatorBackend::Mpi:
      return "mpi";
    case CommunicatorBackend::Nccl:
      return "nccl";
  }
  return "?";
}

CommunicatorBackend parse_communicator_backend(std::string_view name) {
  return detail::parse_name("communicator backend", name, kBackends);
}

bool communicator_backend_built(CommunicatorBackend backend) {
  switch (backend) {
    case CommunicatorBackend::Local:
      return true;
#ifdef MESHFUSE_WITH_GLOO
    case CommunicatorBackend::Gloo:
      return true;
#endif
#ifdef MESHFUSE_WITH_MPI
    case CommunicatorBackend::Mpi:
      return true;
#endif
#ifdef MESHFUSE_WITH_NCCL
    case CommunicatorBackend::Nccl:
      return true;
#endif
    default:
      return false;
  }
}

std::vector<DeviceType> communicator_backend_devices(CommunicatorBackend backend) {
  if (backend == CommunicatorBackend::Nccl) return {DeviceType::CUDA};
#ifdef MESHFUSE_WITH_CUDA
  if (backend == CommunicatorBackend::Local) return {DeviceType::CPU, DeviceType::CUDA};
#endif
  return {DeviceType::CPU};
}

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Prod:
      return "prod";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Avg:
      return "avg";
  }
  return "?";
}

ReduceOp parse_reduce_op(std::string_view name) {
  if (detail::equal_ignoring_case(name, "product")) return ReduceOp::Prod;
  if (detail::equal_ignoring_case(name, "mean")) return ReduceOp::Avg;
  return detail::parse_name("reduce op", name, kReduceOps);
}

bool reducible(DType dtype, ReduceOp op) {
  return dtype != DType::Bool && (op != ReduceOp::Avg || is_floating_point(dtype));
}

std::string_view to_string(CommOp op) {
  switch (op) {
    case CommOp::AllGather:
      return "all_gather";
    case CommOp::ReduceScatter:
      return "reduce_scatter";
    case CommOp::AllReduce:
      return "all_reduce";
    case CommOp::Broadcast:
      return "broadcast";
    case CommOp::Reduce:
      return "reduce";
    case CommOp::Gather:
      return "gather";
    case CommOp::Scatter:
      return "scatter";
    case CommOp::AllToAll:
      return "all_to_all";
    case CommOp::Send:
      return "send";
    case CommOp::Recv:
      return "recv";
    case CommOp::SendRecv:
      return "send_recv";
    case CommOp::Barrier:
      return "barrier";
  }
  return "?";
}

CommOp parse_comm_op(std::string_view name) {
  return detail::parse_name("communication op", name, kCommOps);
}

}  // namespace meshfuse
