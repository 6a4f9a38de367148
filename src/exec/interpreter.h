// The interpreter of a Plan's steps on one rank (internal to exec): what MultiDeviceExecutor::run
// calls once per run.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/exec/executor.h"
#include "meshfuse/exec/lowering.h"
#include "meshfuse/exec/overlap.h"

namespace meshfuse::detail {

// What every run of `plan` reads (PlanFacts, executor.h), derived once when it is lowered:
// last_use, per plan value, the last step reading it (-1: none; an output: the step count), so that
// a run frees each intermediate as soon as it can; communicates, whether it has a Communication or
// an op that communicates (the vocabulary-parallel loss).
PlanFacts plan_facts(const Plan& plan);

class Interpreter {
 public:
  // teams: the communicator of each mesh dimension (empty when the plan communicates nothing);
  // segments: the stretches run chunk by chunk (overlap.h), in step order; chunk_streams: CUDA
  // streams of the inputs' device for the chunks (unused on the CPU); profile: null, or where the
  // steps' times go.
  Interpreter(const Plan& plan, const PlanFacts& facts,
              const std::vector<std::shared_ptr<Communicator>>& teams,
              const std::vector<OverlapSegment>& segments, const std::vector<Stream>& chunk_streams,
              Device device, const Stream& stream, std::vector<StepProfile>* profile);

  std::vector<Tensor> run(const std::vector<TensorView>& inputs);

 private:
  struct Block;
  struct Chunked;
  struct Settle;
  struct Ring;

  const TensorView& view(std::int64_t id) const { return views_[static_cast<std::size_t>(id)]; }
  // The memory of a value this run allocated (undefined: the caller's, or not yet allocated), for
  // Work::keep_alive.
  const Tensor& owner(std::int64_t id) const { return owned_[static_cast<std::size_t>(id)]; }
  // The memory a communication reads for value `id` in place, for Work::keep_alive: this run's
  // own; on the CPU a copy of a caller's input, which a wait that timed out leaves gloo's and
  // mpi's transfers reading after run() has thrown, when the caller may have freed it; undefined
  // on CUDA, where a transfer is ordered on the caller's stream.
  Tensor sendable(std::int64_t id) const;
  const TensorView& allocate(std::int64_t id);
  // The mesh dimension whose team the step (or the segment starting there) talks to; -1: none.
  std::int64_t communicates_over(std::int64_t step) const;
  void release_after(std::int64_t step);
  bool unused_result(const ProgramOp& op, std::size_t j) const;

  void run_step(const Compute& c);
  void run_step(const Slice& s);
  void run_step(const Partition& p);
  void run_step(const Communication& c);
  void all_to_all(Communicator& team, const Communication& c, const TensorView& in,
                  const TensorView& out);
  std::int64_t bytes(const Communication& c) const;

  // Completes a communication: CPU backends before the compute that reads it; CUDA ones are
  // ordered on the stream, so their Work is waited at the end of the run (errors, timeouts).
  void finish(Work work);

  void run_segment(const OverlapSegment& seg);
  void run_collective_segment(Chunked& ch);
  Ring ring_of(const Chunked& ch) const;
  void run_ring_gather(Chunked& ch);
  void run_ring_scatter(Chunked& ch);
  // The segment's ops on one block of rows, their results summed over rows left out.
  void run_block(Chunked& ch, const Block& b, const Stream& stream);
  // Those summed results, once over all rows.
  void run_sums(const Chunked& ch, const Stream& stream);

  const Plan& plan_;
  const PlanFacts& facts_;
  const std::vector<std::shared_ptr<Communicator>>& teams_;
  const std::vector<OverlapSegment>& segments_;
  const std::vector<Stream>& chunk_streams_;
  Device device_;
  Stream stream_;
  std::vector<StepProfile>* profile_;  // null: not profiling
  std::vector<TensorView> views_;
  std::vector<Tensor> owned_;
  std::vector<Work> pending_;  // CUDA communications not yet waited
};

}  // namespace meshfuse::detail
