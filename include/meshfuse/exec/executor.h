// MultiDeviceExecutor: runs a Program (program.h) on the ranks of its DeviceMesh, each rank with
// its local parts of the inputs, through the Plan that lowering.h makes for it (nvFuser's
// MultiDeviceExecutor; DTensor's redistributions).
//
// Every rank of the communicator's team builds an executor of the same program and calls run()
// the same number of times; the mesh's ranks are the team's ranks (a mesh over a subset, or a
// rank the mesh lacks, is InvalidArgument). Before a backend's first communication, and again
// after set_params(), the ranks compare a hash of the program (ops, shapes, placements) and of the
// params that decide the communications: ones that differ are InvalidArgument on every rank,
// naming the first line where they part (compared on the communicator's own backend for the
// inputs' device type, so a rank whose params name another backend meets the others; where the
// communicator has none for it, on the backend the params name, and ranks that name different
// ones wait for the timeout). A rank that calls run() with a program that communicates nothing
// while the others' do leaves them waiting for the communicator's timeout (Error(Timeout)). A run
// that throws on some ranks only (an input of the wrong shape, a bad label) counts as a failed
// collective on each of the executor's teams (Communicator::count_failed_collective): the ranks
// still in its communications, and every rank at the next run, then fail with CommunicationFailure
// "ranks out of step" (with the checks on; on a mesh of several dimensions, ranks whose teams the
// failing rank no longer reaches fail at their timeout) instead of pairing one run's communications
// with another's.
//
// Plans are lowered once per (communicator backend, device type of the inputs) and cached: the
// program and its shapes are fixed, so those are what can change between runs. set_params() with
// another backend lowers again; the communications then run on a communicator of the same team
// with that backend (Communicator::with_backends), set up on first use. Teams along mesh
// dimensions come from Communicator::mesh_teams at the first run of each backend: kept by the
// communicator, so executors (and gather_tensor) on one mesh share them: run them from one thread
// at a time, and after a failed run (a timeout, a dead peer) the shared teams fail for all.
//
// run() allocates every intermediate on the inputs' device (CUDA work on `stream`, and on the
// executor's own streams for overlapped chunks), frees them before it returns, and keeps no state
// between runs. Communications complete before the compute that reads them; params().overlap runs
// the all_gather .. reduce_scatter stretches in chunks, one chunk's communication under another's
// compute (overlap.h). On CUDA, run() returns once every communication has completed on the
// device; later compute may still be queued on `stream`. Results are bitwise the same run to run
// for the same inputs, ranks, backend and parameters.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/exec/lowering.h"
#include "meshfuse/exec/overlap.h"
#include "meshfuse/exec/program.h"

namespace meshfuse {
namespace detail {
// What every run of a plan reads (src/exec/interpreter.h).
struct PlanFacts {
  std::vector<std::int64_t> last_use;
  bool communicates = false;
};
}  // namespace detail

struct MultiDeviceExecutorParams {
  LoweringParams lowering;
  // Communication overlapped with the GEMMs (overlap.h): none, collective or ring; chunks;
  // number_of_streams.
  OverlapParams overlap;
  // Time every step of each run (last_profile()): the stream is synchronised after each step, so
  // nothing overlaps and each step's wall time is its own, and a step that communicates starts
  // after a barrier of its team, so its time leaves out the wait for a slower rank. For
  // measuring, not for production.
  bool profile = false;
  friend bool operator==(const MultiDeviceExecutorParams&,
                         const MultiDeviceExecutorParams&) = default;
};

// One step of a profiled run.
struct StepProfile {
  std::int64_t step = 0;  // index in Plan::steps
  bool communication = false;
  std::int64_t bytes = 0;  // communications: the larger of this rank's input and output bytes
  double ms = 0;           // wall time, the stream synchronised before and after
  // An overlapped segment (overlap.h), steps `step` .. overlapped_to, timed as one; -1 otherwise.
  std::int64_t overlapped_to = -1;
};

class MultiDeviceExecutor {
 public:
  // InvalidArgument when the program's mesh (a one-rank mesh of the team's rank when it has none)
  // is not laid over exactly the communicator's team ranks 0 .. size - 1.
  MultiDeviceExecutor(Program program, std::shared_ptr<Communicator> communicator,
                      MultiDeviceExecutorParams params = {});

  // inputs: this rank's parts of the program's inputs, in Program::inputs() order, each the shape
  // of its placement's part (plan().values[plan().inputs[i]].shape) and the program's dtype, all on
  // one device (any strides). Returns this rank's parts of the outputs, in Program::outputs()
  // order, as their placements say. Errors: InvalidArgument (a wrong count of inputs, a native
  // stream handle with inputs on the CPU), ShapeMismatch / DTypeMismatch / DeviceMismatch naming
  // the input, DeviceMismatch for a stream on another device than the inputs', and those of the
  // ops and communicators.
  std::vector<Tensor> run(const std::vector<TensorView>& inputs, const Stream& stream = {});

  // The plan run() uses for inputs on a device of `type` (lowered now if not yet).
  const Plan& plan(DeviceType type = DeviceType::CPU);
  std::size_t cached_plans() const { return plans_.size(); }
  // The steps of the last run with params().profile set, in order (empty before one).
  const std::vector<StepProfile>& last_profile() const { return profile_; }

  const Program& program() const { return program_; }
  const MultiDeviceExecutorParams& params() const { return params_; }
  // For language bindings whose own conversion of run()'s arguments failed: counts the run as
  // failed on this rank, as run() counts one that throws (see the top of this file). `type`: the
  // inputs' device type; none: that of the last run (the CPU before any).
  void count_failed_run(std::optional<DeviceType> type = std::nullopt);

  // Collective: every rank calls it, with the same params, before its next run(), which compares
  // them across ranks again (backend, overlap, chunks, streams, profile).
  void set_params(MultiDeviceExecutorParams params);

 private:
  CommunicatorBackend backend_for(DeviceType type) const;
  // The team on `backend` that the ranks compare programs on, and those of each mesh dimension.
  std::shared_ptr<Communicator> world(CommunicatorBackend backend, DeviceType type);
  const std::vector<std::shared_ptr<Communicator>>& teams(CommunicatorBackend backend,
                                                          DeviceType type, const Stream& stream);

  void check_same_program(Communicator& world, DeviceType type, const Stream& stream) const;

  Program program_;
  std::shared_ptr<Communicator> communicator_;
  MultiDeviceExecutorParams params_;
  DeviceMesh mesh_;
  // A plan, what every run of it reads, and its overlapped segments for params().overlap.
  struct Lowered {
    Plan plan;
    detail::PlanFacts facts;
    std::vector<OverlapSegment> segments;
    std::optional<OverlapParams> segments_for;
  };
  const Lowered& lowered(DeviceType type);
  std::vector<Tensor> run(const Lowered& lowered, const std::vector<TensorView>& inputs,
                          Device device, const Stream& stream);
  const std::vector<Stream>& chunk_streams(Device device,
                                           const std::vector<OverlapSegment>& segments);

  std::map<std::pair<CommunicatorBackend, DeviceType>, Lowered> plans_;
  std::map<std::pair<CommunicatorBackend, DeviceType>, std::vector<std::shared_ptr<Communicator>>>
      teams_;
  // The (backend, device type)s whose ranks compared programs and params since the last
  // set_params().
  std::set<std::pair<CommunicatorBackend, DeviceType>> checked_;
  bool params_set_ = false;  // set_params() was called: named when the ranks' params differ
  std::vector<StepProfile> profile_;
  DeviceType last_type_ = DeviceType::CPU;  // the inputs' device type at the last run()
  // Per CUDA device index: the chunks' streams, owned, and as Streams.
  std::map<int, std::pair<std::vector<std::shared_ptr<CudaStream>>, std::vector<Stream>>>
      chunk_streams_;
};

// `rank`'s part of a whole tensor placed on `mesh` as `placements` say (a contiguous copy on the
// tensor's device). Partial(sum or prod): the first rank of that mesh dimension holds the part and
// the others the identity (0, 1); Partial(avg, max, min): every rank holds it (partial_identity).
// InvalidArgument: a rank outside the mesh, placements not one per mesh dimension, a Shard outside
// the tensor, a Partial whose op cannot reduce the dtype.
Tensor shard_tensor(const TensorView& tensor, const DeviceMesh& mesh,
                    const std::vector<Placement>& placements, int rank, const Stream& stream = {});

// The whole tensor of global `shape` from every rank's `local` part placed as `placements` say:
// gathered (and Partial terms reduced) on every rank of `communicator`'s team, which `mesh` must
// be laid over. Collective: every rank calls it.
Tensor gather_tensor(const TensorView& local, const Shape& shape, const DeviceMesh& mesh,
                     const std::vector<Placement>& placements,
                     std::shared_ptr<Communicator> communicator, const Stream& stream = {});

}  // namespace meshfuse
