// The names of backends, reduce ops and operations (to_string, parse_*), the backends this build
// has and the device types each serves.
#include <cctype>
#include <string>
#include <vector>

#include "meshfuse/core/error.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

constexpr CommunicatorBackend kBackends[] = {CommunicatorBackend::Local, CommunicatorBackend::Gloo,
                                             CommunicatorBackend::Mpi, CommunicatorBackend::Nccl};
constexpr ReduceOp kReduceOps[] = {ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max,
                                   ReduceOp::Avg};
constexpr CommOp kCommOps[] = {CommOp::AllGather, CommOp::ReduceScatter, CommOp::AllReduce,
                               CommOp::Broadcast, CommOp::Reduce,        CommOp::Gather,
                               CommOp::Scatter,   CommOp::AllToAll,      CommOp::Send,
                               CommOp::Recv,      CommOp::SendRecv,      CommOp::Barrier};

template <typename E, std::size_t N>
std::string names_of(const E (&values)[N]) {
  std::string s;
  for (E v : values) {
    if (!s.empty()) s += ", ";
    s += to_string(v);
  }
  return s;
}

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
  const std::string n = lower(name);
  for (CommunicatorBackend b : kBackends)
    if (n == to_string(b)) return b;
  fail(ErrorCode::InvalidArgument, "communicator backend: unknown name '{}' (expected one of {})",
       name, names_of(kBackends));
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
  const std::string n = lower(name);
  if (n == "product") return ReduceOp::Prod;
  if (n == "mean") return ReduceOp::Avg;
  for (ReduceOp op : kReduceOps)
    if (n == to_string(op)) return op;
  fail(ErrorCode::InvalidArgument, "reduce op: unknown name '{}' (expected one of {})", name,
       names_of(kReduceOps));
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
  const std::string n = lower(name);
  for (CommOp op : kCommOps)
    if (n == to_string(op)) return op;
  fail(ErrorCode::InvalidArgument, "communication op: unknown name '{}' (expected one of {})", name,
       names_of(kCommOps));
}

}  // namespace meshfuse
