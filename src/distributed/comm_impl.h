// What a communicator backend implements (internal). The generic layer (communicator.cpp) checks
// the arguments, runs the cross-rank metadata check through exchange(), builds the CommRecord and
// wraps errors with it; a backend only moves bytes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "meshfuse/distributed/bootstrap.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/distributed/store.h"

namespace meshfuse::detail {

using CommClock = std::chrono::steady_clock;
using Deadline = CommClock::time_point;

// A backend's own timeout for its transfers: the team's when it is set up, then what
// Communicator::set_timeout gives, for the operations that start waiting afterwards (worker
// threads read it).
class BackendTimeout {
 public:
  explicit BackendTimeout(std::chrono::milliseconds timeout) : ms_(timeout.count()) {}
  std::chrono::milliseconds get() const { return std::chrono::milliseconds(ms_.load()); }
  void set(std::chrono::milliseconds timeout) { ms_.store(timeout.count()); }
  Deadline from_now() const { return CommClock::now() + get(); }

 private:
  std::atomic<std::int64_t> ms_;
};

// One operation in flight, as a backend tracks it.
class WorkImpl {
 public:
  virtual ~WorkImpl() = default;
  // True once the operation has finished, successfully or not; never blocks.
  virtual bool test() = 0;
  // Blocks until the operation has finished; throws Error(Timeout) at the deadline, or the
  // operation's failure as an Error (the generic layer heads its message with the record).
  virtual void wait(Deadline deadline) = 0;
};

// A finished operation (for backends that complete synchronously).
std::shared_ptr<WorkImpl> completed_work();

// Operations that finish together: done once each of them is.
std::shared_ptr<WorkImpl> joined_work(std::vector<std::shared_ptr<WorkImpl>> parts);

// An operation another thread completes: finish() marks it done, with the failure (if any) that
// wait() rethrows.
class TaskWork : public WorkImpl {
 public:
  bool test() override;
  void wait(Deadline deadline) override;
  void finish(std::exception_ptr error);

 private:
  std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Runs tasks one at a time, in submission order, on a thread of its own: how a backend with
// blocking transfers (local, gloo) makes them asynchronous. Since every rank submits a team's
// operations in the same order, the queues of the ranks stay in step. The destructor finishes
// the queued tasks, then joins.
class WorkerQueue {
 public:
  explicit WorkerQueue(std::string name);
  ~WorkerQueue();
  WorkerQueue(const WorkerQueue&) = delete;
  WorkerQueue& operator=(const WorkerQueue&) = delete;
  // The task's exception (an Error, or anything else as CommunicationFailure) is rethrown by
  // wait().
  std::shared_ptr<WorkImpl> submit(std::function<void()> task);
  // Runs the queued tasks, then joins the thread (also the destructor's work); idempotent.
  void stop();
  // Fails the tasks not yet begun (CommunicationFailure, `why`) without running them, so that
  // none starts on buffers its caller gave up after an error; the running one goes on.
  void abort(const std::string& why);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// Everything a backend needs to set itself up for one team.
struct TeamContext {
  std::vector<int> team;  // world ranks, in team-rank order
  int rank = 0;           // the caller's team rank
  LaunchInfo launch;      // the world's launch (local_rank picks the CUDA device)
  // Private to this team and backend (a PrefixStore); null when the job has no store (mpirun).
  std::shared_ptr<Store> store;
  std::chrono::milliseconds timeout{};
  // Unique per team and equal on its ranks: "world", "world.s0c1", ... (logs, tags).
  std::string name;
  // Blocking all-gather of `bytes` per rank into `all` (size * bytes, team-rank order) that works
  // before this backend exists: through the store, or the team's CPU backend when there is no
  // store. For out-of-band setup such as NCCL's unique id.
  std::function<void(const void* mine, void* all, std::size_t bytes)> bootstrap_exchange;
  // The local backend's shared state (threads of one process); null for other backends.
  std::shared_ptr<LocalWorldState> local;
};

// A backend's view of one team. Tensors arrive contiguous, of one dtype, on a device the
// backend serves, with every size already checked against the other arguments (and against the
// other ranks when checks are on). Counts are in elements. ReduceOp::Avg is the backend's to
// do (sum, then divide by the team size). CPU backends ignore the stream; CUDA backends queue on
// it (its device is the tensors').
class CommImpl {
 public:
  virtual ~CommImpl() = default;
  virtual CommunicatorBackend backend() const = 0;

  // Blocking all-gather of `bytes` from every rank into `all` (size * bytes, team-rank order);
  // Error(Timeout) at the deadline. The metadata check and split() go through it.
  virtual void exchange(const void* mine, void* all, std::size_t bytes, Deadline deadline) = 0;

  virtual std::shared_ptr<WorkImpl> all_reduce(const TensorView& tensor, ReduceOp op,
                                               const Stream& stream) = 0;
  virtual std::shared_ptr<WorkImpl> broadcast(const TensorView& tensor, int root,
                                              const Stream& stream) = 0;
  virtual std::shared_ptr<WorkImpl> reduce(const TensorView& tensor, int root, ReduceOp op,
                                           const Stream& stream) = 0;
  // counts[r]: elements from rank r, at offset sum(counts[:r]) of output.
  virtual std::shared_ptr<WorkImpl> all_gather(const TensorView& input, const TensorView& output,
                                               const std::vector<std::int64_t>& counts,
                                               const Stream& stream) = 0;
  // counts[r]: elements of the reduced input (offset sum(counts[:r])) that rank r keeps.
  virtual std::shared_ptr<WorkImpl> reduce_scatter(const TensorView& input,
                                                   const TensorView& output,
                                                   const std::vector<std::int64_t>& counts,
                                                   ReduceOp op, const Stream& stream) = 0;
  // Equal blocks; output is undefined on non-roots (gather), input on non-roots (scatter).
  virtual std::shared_ptr<WorkImpl> gather(const TensorView& input, const TensorView& output,
                                           int root, const Stream& stream) = 0;
  virtual std::shared_ptr<WorkImpl> scatter(const TensorView& input, const TensorView& output,
                                            int root, const Stream& stream) = 0;
  // in_counts[s]: elements sent to rank s; out_counts[r]: elements received from rank r.
  virtual std::shared_ptr<WorkImpl> all_to_all(const TensorView& input, const TensorView& output,
                                               const std::vector<std::int64_t>& in_counts,
                                               const std::vector<std::int64_t>& out_counts,
                                               const Stream& stream) = 0;
  virtual std::shared_ptr<WorkImpl> send(const TensorView& tensor, int peer, int tag,
                                         const Stream& stream) = 0;
  virtual std::shared_ptr<WorkImpl> recv(const TensorView& tensor, int peer, int tag,
                                         const Stream& stream) = 0;
  // By default the send, then the recv, as one Work: right for backends whose sends do not wait
  // for their receive (local, gloo, mpi); nccl groups them.
  virtual std::shared_ptr<WorkImpl> send_recv(const TensorView& send_tensor, int dst,
                                              const TensorView& recv_tensor, int src, int tag,
                                              const Stream& stream);
  virtual std::shared_ptr<WorkImpl> barrier(const Stream& stream) = 0;

  // Called once after a timeout or failure: give up in-flight operations as far as the library
  // allows (NCCL: ncclCommAbort). The communicator makes no further calls but the destructor.
  virtual void abort() {}
  // Refuses, before the metadata exchange, tensors on a device this rank's operations cannot run
  // on (Error(DeviceMismatch)): refused later, after the others had exchanged, they waited in
  // the operation until the timeout.
  virtual void check_device(const Device&) {}
  // Communicator::set_timeout: a backend with timeouts of its own takes it (BackendTimeout).
  virtual void set_timeout(std::chrono::milliseconds) {}
};

// One factory per backend, each defined in its backend's file. A backend this build lacks has a
// factory that throws Error(BackendUnavailable) saying how to build it.
std::unique_ptr<CommImpl> make_local_comm(const TeamContext& context);
std::unique_ptr<CommImpl> make_gloo_comm(const TeamContext& context);
std::unique_ptr<CommImpl> make_mpi_comm(const TeamContext& context);
std::unique_ptr<CommImpl> make_nccl_comm(const TeamContext& context);

}  // namespace meshfuse::detail
