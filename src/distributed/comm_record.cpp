// CommRecord::to_string: the line that names an operation in history() and heads its errors.
#include <string>

#include "distributed/comm_state.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse {

namespace {

std::string bytes_str(std::int64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes) / 1024;
  int u = 0;
  while (v >= 1024 && u < 3) {
    v /= 1024;
    ++u;
  }
  return fmt::format("{:.4g} {}", v, kUnits[u]);
}

std::string ranks_str(const std::vector<int>& ranks) {
  std::string s = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? " " : "") + std::to_string(ranks[i]);
  return s + "]";
}

}  // namespace

namespace detail {

bool is_rooted(CommOp op) {
  return op == CommOp::Broadcast || op == CommOp::Reduce || op == CommOp::Gather ||
         op == CommOp::Scatter;
}

}  // namespace detail

std::string CommRecord::to_string() const {
  std::string s(meshfuse::to_string(op));
  if (reduction) s += fmt::format("({})", meshfuse::to_string(*reduction));
  if (op != CommOp::Barrier)
    s += fmt::format(" {} x {}{} ({})", meshfuse::to_string(dtype), count, uneven ? " uneven" : "",
                     bytes_str(bytes));
  s += fmt::format(" on {}, team {}, rank {}", meshfuse::to_string(backend), ranks_str(team), rank);
  if (detail::is_rooted(op)) s += fmt::format(", root {}", root);
  if (op == CommOp::Send || op == CommOp::SendRecv) s += fmt::format(", to {}", root);
  if (op == CommOp::SendRecv) s += fmt::format(", from {}", source);
  if (op == CommOp::Recv) s += fmt::format(", from {}", root);
  return s + fmt::format(", #{}", seq);
}

}  // namespace meshfuse
