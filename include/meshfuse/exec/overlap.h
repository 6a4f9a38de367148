// Overlap of communication with compute in a Plan (lowering.h): where a GEMM waits on an
// all_gather, or a reduce_scatter waits on a GEMM, the executor runs that stretch of the plan one
// chunk of rows at a time, so that one chunk's communication runs while another's compute does
// (nvFuser's collective-based and ring-based pipelining; Megatron-LM's and PyTorch's async tensor
// parallelism).
//
// A segment is a run of consecutive plan steps over one mesh dimension's team that
//   - starts with an all_gather along dim 0 (tokens) and/or ends with a reduce_scatter along dim 0
//     whose input the segment computes and nothing else reads,
//   - and in between holds only row-wise ops: each row of their row operands (x of linear, a of
//     matmul, both operands of add and swiglu, dy and x of their backwards, ...) gives the same row
//     of their row results. Their results summed over rows (linear_backward's weight and bias
//     gradients) are computed once over all rows after the last chunk, under the last
//     reduce_scatter.
// Rows are the M = sum(sizes) rows of the gathered (or scattered) tensor, in the ranks' order.
//
// Forms:
//   collective  every rank's part is cut into `chunks` row chunks (numpy.array_split, so uneven
//               parts and chunks are fine); chunk c's all_gather gathers piece c of every part, and
//               its reduce_scatter scatters them, while chunk c - 1 computes. chunks = 1 is the
//               plan without overlap, in one more buffer.
//   ring        d - 1 send_recv steps around the team, each rank starting from its own part
//               (rank-offset indexing): an all_gather's parts are passed on while the one in hand
//               computes; a reduce_scatter's partial sums are passed on and accumulated, so that
//               rank q ends with its part. A segment with both is run as two: the gathered part up
//               to the last op that reads the gathered tensor, then the rest.
//
// Results equal the plan without overlap within the GEMMs' tolerance: a GEMM on a row chunk can
// take another algorithm than on all rows, and the ring sums the partial products in another
// order (16-bit ones rounded at each step). They are bitwise the same run to run for the same
// ranks, backend and parameters.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace meshfuse {

struct Plan;

enum class Overlap { None, Collective, Ring };
// "none", "collective", "ring".
std::string_view to_string(Overlap overlap);
// Inverse of to_string (case-insensitive); Error(InvalidArgument) listing the names otherwise.
Overlap parse_overlap(std::string_view name);

struct OverlapParams {
  Overlap overlap = Overlap::None;
  // collective: row chunks per rank's part (>= 1); 0: the team size.
  int chunks = 0;
  // CUDA: chunk c runs on stream c % number_of_streams of the executor's own (>= 1). The CPU runs
  // compute on the calling thread and each backend's communications on its own threads.
  int number_of_streams = 2;
  friend bool operator==(const OverlapParams&, const OverlapParams&) = default;
};

// A stretch of a Plan run chunk by chunk.
struct OverlapSegment {
  std::int64_t first = 0, last = 0;  // plan steps [first, last]
  Overlap form = Overlap::Collective;
  std::int64_t mesh_dim = 0;
  std::vector<std::int64_t> sizes;  // each team member's rows
  std::int64_t gather = -1;         // the step of its all_gather (first), or -1
  std::int64_t scatter = -1;        // the step of its reduce_scatter (last), or -1
  int chunks = 1;                   // collective: chunks per part; ring: the team size

  // e.g. "steps 11..16: all_gather + 4 ops + reduce_scatter, collective, 4 chunks".
  std::string to_string() const;
};

// Error(InvalidArgument) naming the field: chunks < 0 or number_of_streams < 1.
void check_overlap_params(const OverlapParams& params);

// The segments of `plan` (in step order, disjoint) for `params`; none for Overlap::None.
// Errors as check_overlap_params.
std::vector<OverlapSegment> find_overlap_segments(const Plan& plan, const OverlapParams& params);

}  // namespace meshfuse
