// Communicators: collectives between the ranks of a team, on one of four backends.
//
//   local  N ranks as threads of one process (LocalWorld, run_local); needs no launcher. CPU
//          tensors, copied through shared memory; and in CUDA builds CUDA tensors, on one GPU or
//          one each, operations queued on the caller's stream (as nccl) and moved by the copy
//          engines (docs/DISTRIBUTED.md, "local on CUDA tensors").
//   gloo   Gloo over TCP (Debian's libgloo-dev); rendezvous through a Store. CPU tensors.
//   mpi    Open MPI, launched with mpirun. CPU tensors. meshfuse initialises MPI, or the program
//          did, with MPI_Init_thread at MPI_THREAD_SERIALIZED or more (BackendUnavailable else).
//   nccl   NCCL, one GPU per rank (the LOCAL rank's device), operations queued on the caller's
//          stream. CUDA tensors.
//
// The backend of an operation follows the device type of its tensors through a BackendSpec
// ("cpu:gloo,cuda:nccl" by default, in the style of torch.distributed.init_process_group), so one
// Communicator serves CPU and CUDA tensors. Backends are set up on first use of their device type.
//
// Every operation is asynchronous and returns a Work; its CommRecord (operation, team, root,
// reduction, dtype, count, bytes, backend) is printable, heads every error message of the
// operation, and the communicator keeps the last few (set_history_size) for debugging and
// comm-bench.
//
// Mismatch safety (on by default, set_checks(false) to skip it): before each collective the
// ranks all-gather a small metadata record (operation, dtype, element counts and split sizes,
// root, reduction) through the operation's backend, and every rank compares all of them. Any
// difference throws Error(InvalidArgument) from the call itself, on EVERY rank, naming the ranks
// and what differed, e.g.
//   "all_reduce(sum) f32 x 1024 on gloo, team [0 1 2 3], rank 0, #7: ranks disagree: rank 0 has
//    f32 x 1024 but rank 2 has f32 x 512".
// The check is one small blocking all-gather per collective (latency, not bandwidth); it makes the
// call wait until every rank of the team has made it. send, recv and send_recv are not checked.
//
// Timeouts: a rank that never arrives gives the others Error(Timeout) after timeout() (from the
// call when checks are on, from Work::wait otherwise; local on CUDA tensors: from the call, which
// meets the other ranks on the host). After a timeout or a transport failure the
// communicator is out of step with its peers and every later call throws
// Error(CommunicationFailure) saying so; a mismatch error leaves it usable. Any timeout counts,
// also a short one given to Work::wait(timeout): to poll, use Work::is_completed().
//
// Tensors: defined and contiguous (InvalidArgument otherwise); one dtype per operation (any DType
// moves; reductions take f32, f64, f16, bf16, i32, i64, u8, u32, and Avg only floating types); all
// tensors of an operation on one device, and the stream on that device too (DeviceMismatch
// otherwise: the default Stream{} is the CPU's, CUDA tensors take Stream{device} or a CudaStream of
// their device). 16-bit reductions are computed in fp32 where the backend lets us choose (local,
// CPU and CUDA, and gloo's reduce_scatter: the whole reduction in fp32, rounded once; gloo's
// all_reduce and reduce, and mpi: fp32 per pairwise step, rounded at each).
// Split sizes count slices along dim 0 (as in torch.distributed.all_to_all_single): a tensor
// with dim-0 size S split into sizes s_0..s_{n-1} (sum S) gives rank r the rows of s_r.
//
// Roots and peers are ranks of the team (0 <= r < size()). A Communicator is driven by one thread
// at a time, and every rank issues the collectives of a team in the same order; Work may be
// waited on from any thread. Tensors must stay alive (and unmodified, for inputs) until their
// Work completes. After a Timeout, and for a Work dropped unwaited, the backend may still read and
// write the tensors of the operations that had not finished (gloo and mpi cannot cancel a
// transfer): keep them alive while Work::in_flight(), or give them to Work::keep_alive; a dropped
// Work's until the communicator is destroyed (mpi: until the process ends, MPI never gives them
// up).
//
// Errors of every call: InvalidArgument (bad root/peer, undefined or non-contiguous tensors, sizes
// that do not add up, a mismatch between ranks), DTypeMismatch (input and output dtypes differ),
// DeviceMismatch (tensors or stream on different devices), BackendUnavailable (the spec names a
// backend this build lacks, or no backend serves the device type), Timeout,
// CommunicationFailure.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshfuse/core/device.h"
#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/distributed/bootstrap.h"
#include "meshfuse/distributed/device_mesh.h"
#include "meshfuse/distributed/store.h"

namespace meshfuse {

enum class CommunicatorBackend { Local, Gloo, Mpi, Nccl };

// "local", "gloo", "mpi", "nccl".
std::string_view to_string(CommunicatorBackend backend);
// Inverse of to_string (case-insensitive); Error(InvalidArgument) listing the names otherwise.
CommunicatorBackend parse_communicator_backend(std::string_view name);
// Whether this build has the backend (local always; gloo, mpi with MESHFUSE_GLOO / MESHFUSE_MPI;
// nccl with CUDA and NCCL).
bool communicator_backend_built(CommunicatorBackend backend);
// The device types a backend serves: local -> cpu, and cuda in CUDA builds; gloo, mpi -> cpu;
// nccl -> cuda.
std::vector<DeviceType> communicator_backend_devices(CommunicatorBackend backend);
// The NCCL library of the nccl backend, as "NCCL 2.28.3 (libnccl.so.2)". NCCL is opened at run
// time (here or at the first nccl communicator), not linked, so that a process with PyTorch loaded
// first shares PyTorch's NCCL; MESHFUSE_NCCL_LIBRARY names another file. Error(BackendUnavailable)
// when the build has no nccl backend or no NCCL library loads.
std::string nccl_library();

// torch.distributed.ReduceOp: SUM, PRODUCT, MIN, MAX, AVG (sum divided by the team size).
enum class ReduceOp { Sum, Prod, Min, Max, Avg };
// "sum", "prod", "min", "max", "avg".
std::string_view to_string(ReduceOp op);
// Inverse of to_string (case-insensitive; also "product", "mean"); Error(InvalidArgument) listing
// the names otherwise.
ReduceOp parse_reduce_op(std::string_view name);
// Whether `op` reduces `dtype`: bool never, Avg only floating dtypes.
bool reducible(DType dtype, ReduceOp op);

// Which backend serves each device type.
struct BackendSpec {
  std::map<DeviceType, CommunicatorBackend> backends;

  // Parses "cpu:gloo,cuda:nccl" (device:backend pairs) or one backend name, which then serves
  // every device type it can (communicator_backend_devices): "gloo" -> cpu:gloo, "nccl" ->
  // cuda:nccl, "local" -> cpu:local,cuda:local (cpu:local without CUDA). Empty text -> default(). Error(InvalidArgument) on unknown names, a device listed
  // twice, or a backend that cannot serve the device ("cuda:gloo").
  static BackendSpec parse(std::string_view text);
  // cpu:gloo,cuda:nccl.
  static BackendSpec defaults();

  // The backend for a device type; Error(BackendUnavailable) naming the spec when none.
  CommunicatorBackend for_device(DeviceType type) const;
  // "cpu:gloo,cuda:nccl".
  std::string str() const;
};

// The kinds of operation, named as in torch.distributed.
enum class CommOp {
  AllGather,
  ReduceScatter,
  AllReduce,
  Broadcast,
  Reduce,
  Gather,
  Scatter,
  AllToAll,
  Send,
  Recv,
  SendRecv,
  Barrier,
};
// "all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "gather", "scatter",
// "all_to_all", "send", "recv", "send_recv", "barrier".
std::string_view to_string(CommOp op);
// Inverse of to_string; Error(InvalidArgument) otherwise.
CommOp parse_comm_op(std::string_view name);

// What one operation did, as seen from one rank.
struct CommRecord {
  CommOp op = CommOp::Barrier;
  CommunicatorBackend backend = CommunicatorBackend::Local;
  std::vector<int> team;  // world ranks of the team, in team-rank order
  int rank = 0;           // the caller's rank in the team
  int root = -1;          // team rank of the root (broadcast, reduce, gather, scatter) or the peer
                          // (send and send_recv: destination, recv: source); -1 otherwise
  int source = -1;        // send_recv: the team rank received from; -1 otherwise
  std::optional<ReduceOp> reduction;  // all_reduce, reduce, reduce_scatter
  DType dtype = DType::U8;
  // Elements per rank: the tensor (all_reduce, broadcast, reduce, send, recv; send_recv: the one
  // sent), the caller's input
  // (all_gather, gather, all_to_all) or the caller's output (reduce_scatter, scatter).
  std::int64_t count = 0;
  std::int64_t bytes = 0;  // the larger of the caller's input and output bytes: the nccl-tests
                           // "size" (all_gather: the gathered output, reduce_scatter: the input)
  std::uint64_t seq = 0;   // position among the operations of this communicator, from 0
  bool uneven = false;     // called with split sizes that differ between ranks

  // e.g. "all_reduce(sum) f32 x 1024 (4 KiB) on gloo, team [0 1 2 3], rank 1, #7";
  // "broadcast f32 x 8 (32 B) on local, team [0 1], rank 0, root 1, #0".
  std::string to_string() const;
};

namespace detail {
struct WorkState;
class CommImpl;
struct CommState;
struct LocalWorldState;
}  // namespace detail

// The handle of one asynchronous operation (like c10d's Work). Copies share the operation.
class Work {
 public:
  Work() = default;  // an empty handle: completed, nothing to wait for
  explicit Work(std::shared_ptr<detail::WorkState> state);

  // Blocks until the operation has finished (CPU backends: its results are in the outputs and the
  // inputs may be reused; CUDA: finished on the device; later work on the caller's stream is
  // ordered after it without any wait). Throws the operation's error, its message headed by the
  // record's text: Timeout when not finished after `timeout` (default: the communicator's),
  // CommunicationFailure when a transport failed. Waiting again rethrows the same error. A
  // Timeout, whatever `timeout` was, makes the communicator unusable (see the top of this file).
  void wait();
  void wait(std::chrono::milliseconds timeout);
  // True once the operation has finished, successfully or not; never blocks.
  bool is_completed() const;
  // Whether the backend may still read or write the operation's tensors: until its transfer has
  // ended, successfully or not. After a wait that timed out the transfer may go on (gloo, mpi),
  // so a binding that keeps the tensors alive keeps them while this is true. Never blocks.
  bool in_flight() const;
  // The operation's record; an empty handle has a default record.
  const CommRecord& record() const;
  // Gives the work the buffers its operation reads or writes, to be freed once the backend is done
  // with them rather than with the last handle: a wait that timed out leaves gloo's and mpi's
  // transfers going, and buffers freed as that error unwinds would still be read and written.
  // A work dropped in flight with buffers is kept in a process-wide list; they are freed by the
  // first operation started (on any communicator, on its thread) after the transfer ends.
  // Undefined tensors are skipped; an empty handle keeps nothing. Returns *this.
  Work& keep_alive(std::initializer_list<Tensor> buffers);

 private:
  std::shared_ptr<detail::WorkState> state_;
};

// The longest timeout taken: a year (now + timeout must not overflow the clock).
inline constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 365);

struct CommOptions {
  // Backend spec (BackendSpec::parse); empty: BackendSpec::defaults(), or "local" for LocalWorld.
  std::string backend;
  // How long a rank waits for its peers (the check, Work::wait, the backends' own transfers);
  // positive and at most kMaxTimeout (InvalidArgument otherwise, also from set_timeout and
  // Work::wait(timeout)).
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // The metadata check before each collective.
  bool check = true;
  // How many CommRecords the communicator keeps (history()).
  std::size_t history = 0;
};

// A team of ranks and the backends that move its tensors. Create the world communicator with
// init_communicator() (one per process, from the launcher's environment) or LocalWorld (threads),
// and sub-teams with split() / new_group().
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;  // in this team
  int size() const;
  // World ranks of the members in team-rank order (the world communicator: 0..size-1).
  const std::vector<int>& team() const;
  const BackendSpec& spec() const;
  // The backend serving a device type; Error(BackendUnavailable) when the spec has none.
  CommunicatorBackend backend(DeviceType type = DeviceType::CPU) const;

  // The timeout of the metadata check, of Work::wait() and of the backends' own transfers (gloo's
  // and local's; mpi and nccl have none of their own) for operations started afterwards (gloo:
  // also those queued but not yet begun).
  // set_timeout and set_checks also set them, at once, on the teams this communicator keeps
  // (with_backends, mesh_teams); a kept team set directly keeps its own setting until then. Teams
  // from split and new_group take them when made.
  std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds timeout);
  bool checks() const;
  void set_checks(bool on);
  // The last history_size() records, oldest first.
  std::vector<CommRecord> history() const;
  std::size_t history_size() const;
  void set_history_size(std::size_t n);

  // Sub-teams (collective over this team, like MPI_Comm_split): the ranks passing the same
  // color >= 0 form a team, ordered by (key, rank here); a negative color joins no team and gets
  // nullptr. The new team inherits the spec, timeout, checks and history size.
  std::shared_ptr<Communicator> split(int color, int key = 0);
  // The team of `ranks` (ranks here, listed in the new team's order, no duplicates), e.g. one
  // dimension of a DeviceMesh. Every rank of this team calls it with the same list (checked);
  // non-members get nullptr.
  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks);
  // The same team on the backends of `spec` (e.g. an executor's plan on gloo in a job whose world
  // was made with the default spec). Not collective: its backends are set up on first use, as any
  // team's, and one that needs what the job lacks (a store, mpirun, a LocalWorld) fails then,
  // saying so. Every rank makes the same calls in the same order. Kept: a later call with an
  // equal spec returns the same communicator, so that its backends' connections are set up once.
  // Error(BackendUnavailable) for a backend this build lacks.
  std::shared_ptr<Communicator> with_backends(const BackendSpec& spec);
  // The teams of `mesh`, laid over this team's ranks 0 .. size() - 1, one per mesh dimension:
  // team m holds the ranks that share every coordinate but m, ordered along m (DTensor's
  // DeviceMesh.get_group(m)); on a 1-D mesh in rank order, this communicator itself. Made by
  // split() on the first call for a mesh (collective over this team) and kept: a later call for
  // an equal mesh returns the same teams without communicating, so that executors and
  // gather_tensor on one mesh share them (each split sets up new backend connections and writes
  // new store keys). Being shared, the teams are driven by one thread at a time across all their
  // users, and a team that failed (a timeout, a dead peer) fails every later user too. Every rank
  // asks for the same meshes in the same order. Error(InvalidArgument) for a mesh of other ranks.
  std::vector<std::shared_ptr<Communicator>> mesh_teams(const DeviceMesh& mesh);

  // For language bindings that check a collective's arguments before calling it: counts a
  // collective that failed those checks as a call that fails its own checks is counted, so that
  // the team's next metadata exchange finds the ranks out of step (CommunicationFailure on every
  // rank) instead of pairing this rank's next collective with the others' current one. Not for
  // send, recv and send_recv, which have no exchange.
  void count_failed_collective();

  // In place: tensor = op over the ranks' tensors (same numel and dtype on every rank).
  Work all_reduce(const TensorView& tensor, ReduceOp op = ReduceOp::Sum, const Stream& stream = {});
  // In place: every rank's tensor = root's.
  Work broadcast(const TensorView& tensor, int root, const Stream& stream = {});
  // In place on root: tensor = op over the ranks' tensors; the other ranks' tensors are left as
  // they were.
  Work reduce(const TensorView& tensor, int root, ReduceOp op = ReduceOp::Sum,
              const Stream& stream = {});

  // Equal shards: output (numel = size() * input numel) = the ranks' inputs concatenated in rank
  // order (torch all_gather_into_tensor).
  Work all_gather(const TensorView& input, const TensorView& output, const Stream& stream = {});
  // Uneven shards: rank r contributes output_split_sizes[r] rows (input.size(0) on rank r);
  // output holds their sum, rows in rank order; trailing dims equal input's. The same sizes on
  // every rank.
  Work all_gather(const TensorView& input, const TensorView& output,
                  const std::vector<std::int64_t>& output_split_sizes, const Stream& stream = {});

  // Equal shards: input (numel = size() * output numel) is reduced over the ranks and rank r
  // keeps block r (torch reduce_scatter_tensor).
  Work reduce_scatter(const TensorView& input, const TensorView& output,
                      ReduceOp op = ReduceOp::Sum, const Stream& stream = {});
  // Uneven shards: rank r keeps input_split_sizes[r] rows (output.size(0) on rank r) of the
  // reduced input (input.size(0) = their sum). The same sizes on every rank.
  Work reduce_scatter(const TensorView& input, const TensorView& output,
                      const std::vector<std::int64_t>& input_split_sizes,
                      ReduceOp op = ReduceOp::Sum, const Stream& stream = {});

  // root's output (numel = size() * input numel) = the inputs in rank order; output is ignored
  // (may be undefined) on the other ranks.
  Work gather(const TensorView& input, const TensorView& output, int root,
              const Stream& stream = {});
  // Rank r's output = block r of root's input (numel = size() * output numel); input is ignored
  // (may be undefined) on the other ranks.
  Work scatter(const TensorView& input, const TensorView& output, int root,
               const Stream& stream = {});

  // Rank r sends rows [sum(in[:s]), +in[s]) of its input to rank s, which stores them at rows
  // [sum(out[:r]), +out[r]) of its output (torch all_to_all_single; note the argument order:
  // input splits first). Empty split lists: equal blocks of numel / size() elements. Every
  // rank's out[r] must equal rank r's in[this rank] (checked).
  Work all_to_all(const TensorView& input, const TensorView& output,
                  const std::vector<std::int64_t>& input_split_sizes = {},
                  const std::vector<std::int64_t>& output_split_sizes = {},
                  const Stream& stream = {});

  // Point to point; a send matches the recv of the same (source, destination, tag), in order,
  // and must have its byte count. A recv of another size: local fails at once; mpi fails a
  // smaller recv at wait (truncation) and fills a larger one only in part; gloo pairs messages by
  // tag and size, so the recv matches no send and times out (and sends of one tag but different
  // sizes may be received out of order); nccl does not check (NCCL requires equal counts).
  // local on CUDA tensors: a send only posts its buffer and returns; the recv blocks the host
  // until the matching send is posted (up to the timeout), then queues the copy on its stream.
  // The send's Work completes once that copy has finished: keep the send's buffer alive and
  // unmodified until then (wait on it before reusing the buffer).
  Work send(const TensorView& tensor, int dst, int tag = 0, const Stream& stream = {});
  Work recv(const TensorView& tensor, int src, int tag = 0, const Stream& stream = {});
  // A send to dst and a recv from src issued together (MPI_Sendrecv; torch.distributed's
  // batch_isend_irecv of two ops), one Work for both. What a ring step needs: on nccl, separate
  // sends and receives on one stream deadlock when every rank sends first, so the pair runs as
  // one NCCL group. The tensors share a dtype and device; their sizes may differ. The same
  // matching and buffer rules as send and recv apply; dst may equal src.
  Work send_recv(const TensorView& send_tensor, int dst, const TensorView& recv_tensor, int src,
                 int tag = 0, const Stream& stream = {});

  // Completes once every rank has called it, on the backend of the stream's device type (CPU by
  // default).
  Work barrier(const Stream& stream = {});

 private:
  friend struct detail::CommState;
  explicit Communicator(std::unique_ptr<detail::CommState> state);
  void for_kept_teams(const std::function<void(Communicator&)>& f);
  std::unique_ptr<detail::CommState> state_;
};

// The world communicator of this process, from its launcher's environment: ranks from
// launch_info_from_env(), the store from store_from_env() (gloo and nccl need one; mpi takes its
// ranks from mpirun and needs none), and the backend spec from options.backend or, when that is
// empty, MESHFUSE_BACKEND (set by `meshfuse launch --backend`). A process started without a
// launcher, store or backend name is a world of one rank on the local backend. Once per process:
// while the communicator it gave (or a team split from it) lives, a second call is
// Error(InvalidArgument) (split, new_group and with_backends make more teams).
std::shared_ptr<Communicator> init_communicator(const CommOptions& options = {});
// Same with the launch and store given (tests, embedding); store may be null for mpi.
std::shared_ptr<Communicator> init_communicator(const LaunchInfo& launch,
                                                std::shared_ptr<Store> store,
                                                const CommOptions& options = {});

// N ranks as threads of this process, on the local backend (CommOptions::backend empty or
// "local": every device type it serves, or e.g. "cpu:local"). Each thread takes its rank's
// communicator once; the world lives as long as any of them. On CUDA tensors each rank queues on
// its own stream; ranks may share a GPU, and a rank keeps the GPU of its first CUDA operation.
class LocalWorld {
 public:
  explicit LocalWorld(int size, const CommOptions& options = {});
  ~LocalWorld();
  int size() const { return size_; }
  // Rank `rank`'s communicator (one call per rank; InvalidArgument on a second call).
  std::shared_ptr<Communicator> communicator(int rank);
  // Breaks the world for good (a rank that cannot go on, e.g. its code threw): every rank waiting
  // in a collective or a recv of any of its teams, and every later one, fails at once with
  // CommunicationFailure saying `why`, instead of at its timeout. The first reason given stays.
  void abort(const std::string& why);
  // Rank `rank`'s thread is done with its communicators (its run_local function returned): on CPU
  // tensors, the collectives of every team it is in, now and later, and the recvs from it that no
  // send it made matches fail at once with CommunicationFailure naming it, as they can never
  // complete; the rest goes on. (Operations on CUDA tensors still wait for their timeout.)
  void rank_returned(int rank);

 private:
  int size_;
  CommOptions options_;
  BackendSpec spec_;  // every device type on local
  std::shared_ptr<detail::LocalWorldState> state_;
};

// Runs fn(communicator) for ranks 0..size-1 on `size` threads of a LocalWorld and joins them;
// then rethrows the exception of the rank that threw first, if any. A rank that throws aborts the
// world (LocalWorld::abort), so the others stop waiting for it at once; a rank that returns fails
// only the teams it is in (LocalWorld::rank_returned).
void run_local(int size, const std::function<void(Communicator&)>& fn,
               const CommOptions& options = {});
// The same with fn given each rank's communicator as owned: what fn builds on it (a
// MultiDeviceExecutor) may keep it past run_local. `poll`, when given, is called on the calling
// thread about every 100 ms while ranks run (the Python binding checks for Ctrl-C there); an
// exception from it aborts the world, so the ranks waiting in collectives or recvs fail at once,
// and is rethrown once every rank has returned.
void run_local(int size, const std::function<void(const std::shared_ptr<Communicator>&)>& fn,
               const CommOptions& options = {}, const std::function<void()>& poll = {});

}  // namespace meshfuse
