// The metadata check: what every rank says about an operation (or a split), and the comparison
// that makes every rank throw the same error when they disagree.
#include <string>
#include <vector>

#include "distributed/comm_state.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {

std::string list_str(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s + "]";
}

namespace {

// The part of a rank's metadata every rank must agree on, as text for the error.
std::string signature(const Meta& m) {
  if (m.h.op == kSplitOp) {
    if (!m.h.split_sizes) return "split";
    // The list of ranks, without the -1s that pad it to the team's size.
    std::vector<std::int64_t> ranks;
    for (const std::int64_t r : m.in)
      if (r >= 0) ranks.push_back(r);
    return "new_group " + list_str(ranks);
  }
  const auto op = static_cast<CommOp>(m.h.op);
  std::string s(to_string(op));
  if (m.h.reduction >= 0) s += fmt::format("({})", to_string(static_cast<ReduceOp>(m.h.reduction)));
  if (op == CommOp::Barrier) return s;
  s += fmt::format(" {}", to_string(static_cast<DType>(m.h.dtype)));
  const bool shared_splits =
      m.h.split_sizes && (op == CommOp::AllGather || op == CommOp::ReduceScatter);
  if (shared_splits)
    s += " split " + list_str(op == CommOp::AllGather ? m.out : m.in) + " elements";
  else if (op != CommOp::AllToAll)
    s += fmt::format(" x {}", m.h.count);
  if (is_rooted(op)) s += fmt::format(", root {}", m.h.root);
  return s;
}

}  // namespace

void compare(const std::vector<Meta>& metas) {
  const int n = static_cast<int>(metas.size());
  // Each rank's exchange number: ranks that differ met in different operations, and cannot meet
  // in the same one again.
  std::string numbers;
  bool in_step = true;
  for (int r = 0; r < n; ++r) {
    numbers += fmt::format("{}rank {}: #{} ({})", r ? ", " : "", r,
                           static_cast<std::uint32_t>(metas[r].h.exchange), signature(metas[r]));
    in_step = in_step && metas[r].h.exchange == metas[0].h.exchange;
  }
  MESHFUSE_CHECK(in_step, ErrorCode::CommunicationFailure,
                 "ranks out of step: they reached different operations ({}); a collective that "
                 "failed its argument checks on some ranks only is skipped there: the team "
                 "cannot be used again",
                 numbers);
  const std::string first = signature(metas[0]);
  std::string others;
  for (int r = 1; r < n; ++r)
    if (const std::string s = signature(metas[r]); s != first)
      others += fmt::format("{}rank {} has {}", others.empty() ? "" : ", ", r, s);
  MESHFUSE_CHECK(others.empty(), ErrorCode::InvalidArgument, "ranks disagree: rank 0 has {} but {}",
                 first, others);
  if (metas[0].h.op == kSplitOp) return;
  const auto op = static_cast<CommOp>(metas[0].h.op);
  if (op == CommOp::AllToAll) {
    for (int r = 0; r < n; ++r)
      for (int s = 0; s < n; ++s)
        MESHFUSE_CHECK(metas[r].in[s] == metas[s].out[r], ErrorCode::InvalidArgument,
                       "ranks disagree: rank {} sends {} elements to rank {}, which expects {}", r,
                       metas[r].in[s], s, metas[s].out[r]);
  }
}

}  // namespace meshfuse::detail
