// The local backend on CUDA tensors: the ranks are threads of one process, each queuing on its own
// stream, on one GPU or several; data moves on the copy engines (cudaMemcpyAsync, peer copies
// between GPUs) and only reductions run a kernel. Nothing here waits for the device.
//
// An operation is queued on the caller's stream from the calling thread, as NCCL does. It is a few
// steps; at each one a rank records an event on its stream, posts it with its buffers' addresses
// at a meeting of the team (the host barrier of local.h), and makes its stream wait on every
// peer's event. The first step says "my inputs are ready"; the copies each rank then queues pull
// from the peers' buffers into its own outputs (a rank writes only its own memory); the last step
// says "I have read your buffers", so no rank's later work overwrites memory a peer still reads.
// In-place reductions take one more step: rank r reduces chunk r of every rank's tensor into a
// scratch, and after the middle step every rank copies the chunks from the scratches into its own
// tensor, so every rank holds the same bits.
//
// Event reuse: two events (and two posting slots) per rank, used in turn. The one posted at
// meeting m is waited on (cudaStreamWaitEvent captures its record at the call) by every peer
// before it arrives at meeting m + 1, and it is recorded again only before meeting m + 2, i.e.
// after meeting m + 1 has let this rank through, when every peer has arrived there.
//
// Point to point: a send records an event of its own and posts (address, bytes, event) in the
// (source, destination, tag) queue, without waiting for anything, so a ring of sends issued before
// the receives cannot deadlock. A recv waits on the host (up to the timeout) for the matching
// send, queues the copy after the send's event and records a "consumed" event. The send's Work
// completes once that copy has finished: until then, the send's buffer must stay alive and
// unmodified (the caller's later work on its stream is not ordered after the receiver's copy).
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "distributed/local.h"
#include "meshfuse/core/error.h"

#if MESHFUSE_WITH_CUDA

#include <cuda_runtime.h>

#include <thread>

#include "core/cuda/memory_pool.h"
#include "core/cuda/runtime.h"
#include "distributed/local_reduce.h"

namespace meshfuse::detail {
namespace {

void check_cuda(cudaError_t status, std::string_view what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky error so the next call starts clean
  fail(ErrorCode::CommunicationFailure, "local: {}: CUDA error {} ({})", what,
       cudaGetErrorName(status), cudaGetErrorString(status));
}

cudaStream_t native(const Stream& stream) { return static_cast<cudaStream_t>(stream.native); }

// A CUDA event of one device, without timing.
class Event {
 public:
  explicit Event(int device) {
    const cuda::DeviceGuard guard(device);
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) const {
    check_cuda(cudaEventRecord(event_, stream), "cudaEventRecord");
  }
  bool done() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    check_cuda(status, "cudaEventQuery");
    return true;
  }
  // Polls until the event has completed; Error(Timeout) at the deadline.
  void wait(Deadline deadline) const {
    // Yield-spin through the first 2 ms, then poll every 20 us (as the nccl backend).
    const auto spin_until = CommClock::now() + std::chrono::milliseconds(2);
    while (!done()) {
      const auto now = CommClock::now();
      if (now >= deadline)
        fail(ErrorCode::Timeout, "local: the operation did not finish on the device");
      if (now < spin_until)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// Lets `device` read and write the memory of `peer`: cudaMalloc'd memory (peer access) and
// meshfuse's pool on `peer` (tensors, scratches), once per pair in the process. False when the
// devices cannot reach each other: copies then still work (cudaMemcpyPeerAsync goes through the
// host), reductions cannot.
bool enable_peer_access(int device, int peer) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, bool> known;
  std::lock_guard lock(mutex);
  const auto it = known.find({device, peer});
  if (it != known.end()) return it->second;
  int can = 0;
  check_cuda(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
  if (can) {
    const cuda::DeviceGuard guard(device);
    const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
    if (status == cudaErrorPeerAccessAlreadyEnabled)
      cudaGetLastError();  // enabled by someone else in this process (PyTorch): fine
    else
      check_cuda(status, "cudaDeviceEnablePeerAccess");
    cudaMemAccessDesc access{};
    access.location.type = cudaMemLocationTypeDevice;
    access.location.id = device;
    access.flags = cudaMemAccessFlagsProtReadWrite;
    check_cuda(cudaMemPoolSetAccess(memory_pool(peer), &access, 1), "cudaMemPoolSetAccess");
  }
  known[{device, peer}] = can != 0;
  return can != 0;
}

// What a rank posts at a meeting: its event, recorded on its stream just before, and where the
// peers find its buffers for this step.
struct Post {
  cudaEvent_t event = nullptr;
  int device = 0;
  const std::uint8_t* data = nullptr;    // the input, or the scratch of an in-place reduction
  const std::int64_t* counts = nullptr;  // all_to_all: elements for each rank
};

// A send, from its post until a recv takes it.
struct Message {
  Message(const void* data, std::size_t bytes, int device)
      : data(data), bytes(bytes), device(device), ready(device) {}
  const void* data;
  std::size_t bytes;
  int device;
  Event ready;  // recorded on the sender's stream after the send was called
  bool taken = false;
  std::shared_ptr<Event> consumed;  // the receiver's, recorded after its copy; null on a mismatch
};

using P2PKey = std::tuple<int, int, int>;  // source, destination, tag

}  // namespace

struct LocalCudaTeam {
  explicit LocalCudaTeam(int size) : ops(size) {}

  Meeting ops;  // collectives, on the calling threads

  std::mutex p2p_mutex;
  std::condition_variable p2p_changed;
  std::map<P2PKey, std::deque<std::shared_ptr<Message>>> sent;  // not yet received
};

namespace {

// An operation queued on a stream: an event recorded after it.
class EventWork : public WorkImpl {
 public:
  explicit EventWork(std::shared_ptr<Event> event) : event_(std::move(event)) {}
  bool test() override { return event_->done(); }
  void wait(Deadline deadline) override { event_->wait(deadline); }

 private:
  std::shared_ptr<Event> event_;
};

// A send: finished once a recv has taken it and its copy has finished on the device.
class SendWork : public WorkImpl {
 public:
  SendWork(std::shared_ptr<LocalCudaTeam> team, P2PKey key, std::shared_ptr<Message> message)
      : team_(std::move(team)), key_(key), message_(std::move(message)) {}

  bool test() override {
    std::shared_ptr<Event> consumed;
    {
      std::lock_guard lock(team_->p2p_mutex);
      if (!message_->taken) return false;
      consumed = message_->consumed;
    }
    return !consumed || consumed->done();
  }

  void wait(Deadline deadline) override {
    std::shared_ptr<Event> consumed;
    {
      std::unique_lock lock(team_->p2p_mutex);
      if (!team_->p2p_changed.wait_until(lock, deadline, [&] { return message_->taken; })) {
        // Withdrawn, so that a late recv does not read a buffer its owner may reuse.
        auto& queue = team_->sent[key_];
        queue.erase(std::find(queue.begin(), queue.end(), message_));
        message_->taken = true;
        fail(ErrorCode::Timeout, "local: no matching recv took the send");
      }
      consumed = message_->consumed;
    }
    if (consumed) consumed->wait(deadline);
  }

 private:
  std::shared_ptr<LocalCudaTeam> team_;
  P2PKey key_;
  std::shared_ptr<Message> message_;
};

std::vector<std::int64_t> offsets(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> off(counts.size() + 1, 0);
  for (std::size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

std::uint8_t* bytes_of(const TensorView& t) { return static_cast<std::uint8_t*>(t.data()); }

class LocalCudaComm : public CommImpl {
 public:
  LocalCudaComm(const TeamContext& context, std::shared_ptr<LocalCudaTeam> team)
      : rank_(context.rank),
        size_(static_cast<int>(context.team.size())),
        timeout_(context.timeout),
        team_(std::move(team)),
        peer_ready_(static_cast<std::size_t>(size_), false) {}

  CommunicatorBackend backend() const override { return CommunicatorBackend::Local; }
  void set_timeout(std::chrono::milliseconds timeout) override { timeout_.set(timeout); }

  void exchange(const void*, void*, std::size_t, Deadline) override {
    fail(ErrorCode::Internal, "local: the metadata exchange goes through the CPU side");
  }

  std::shared_ptr<WorkImpl> all_reduce(const TensorView& t, ReduceOp op,
                                       const Stream& stream) override {
    return reduce_in_place(t, op, -1, stream);
  }

  std::shared_ptr<WorkImpl> reduce(const TensorView& t, int root, ReduceOp op,
                                   const Stream& stream) override {
    return reduce_in_place(t, op, root, stream);
  }

  std::shared_ptr<WorkImpl> broadcast(const TensorView& t, int root,
                                      const Stream& stream) override {
    Op o(*this, stream);
    const auto posts = step(o, Post{nullptr, 0, bytes_of(t)});
    if (rank_ != root) copy(o, bytes_of(t), posts[root], posts[root].data, t.nbytes());
    return finish(o);
  }

  std::shared_ptr<WorkImpl> all_gather(const TensorView& in, const TensorView& out,
                                       const std::vector<std::int64_t>& counts,
                                       const Stream& stream) override {
    Op o(*this, stream);
    const std::size_t es = element_size(in.dtype());
    const auto off = offsets(counts);
    const auto posts = step(o, Post{nullptr, 0, bytes_of(in)});
    for (int s = 0; s < size_; ++s)
      copy(o, bytes_of(out) + off[s] * es, posts[s], posts[s].data, counts[s] * es);
    return finish(o);
  }

  std::shared_ptr<WorkImpl> reduce_scatter(const TensorView& in, const TensorView& out,
                                           const std::vector<std::int64_t>& counts, ReduceOp op,
                                           const Stream& stream) override {
    check_reducible_team("reduce_scatter");
    Op o(*this, stream);
    const std::size_t es = element_size(in.dtype());
    const auto off = offsets(counts);
    const auto posts = step(o, Post{nullptr, 0, bytes_of(in)});
    std::vector<const void*> srcs;
    for (int s = 0; s < size_; ++s)
      srcs.push_back(readable(posts, s, "reduce_scatter") + off[rank_] * es);
    cuda_reduce_buffers(in.dtype(), op, srcs, out.data(), counts[rank_], stream);
    return finish(o);
  }

  std::shared_ptr<WorkImpl> gather(const TensorView& in, const TensorView& out, int root,
                                   const Stream& stream) override {
    Op o(*this, stream);
    const auto posts = step(o, Post{nullptr, 0, bytes_of(in)});
    if (rank_ == root)
      for (int s = 0; s < size_; ++s)
        copy(o, bytes_of(out) + s * in.nbytes(), posts[s], posts[s].data, in.nbytes());
    return finish(o);
  }

  std::shared_ptr<WorkImpl> scatter(const TensorView& in, const TensorView& out, int root,
                                    const Stream& stream) override {
    Op o(*this, stream);
    const auto posts = step(o, Post{nullptr, 0, rank_ == root ? bytes_of(in) : nullptr});
    copy(o, bytes_of(out), posts[root], posts[root].data + rank_ * out.nbytes(), out.nbytes());
    return finish(o);
  }

  std::shared_ptr<WorkImpl> all_to_all(const TensorView& in, const TensorView& out,
                                       const std::vector<std::int64_t>& in_counts,
                                       const std::vector<std::int64_t>& out_counts,
                                       const Stream& stream) override {
    Op o(*this, stream);
    const std::size_t es = element_size(in.dtype());
    const auto out_off = offsets(out_counts);
    const auto posts = step(o, Post{nullptr, 0, bytes_of(in), in_counts.data()});
    for (int s = 0; s < size_; ++s) {
      std::int64_t from = 0;  // where rank s's block for this rank starts
      for (int r = 0; r < rank_; ++r) from += posts[s].counts[r];
      copy(o, bytes_of(out) + out_off[s] * es, posts[s], posts[s].data + from * es,
           out_counts[s] * es);
    }
    return finish(o);
  }

  std::shared_ptr<WorkImpl> send(const TensorView& t, int peer, int tag,
                                 const Stream& stream) override {
    Op o(*this, stream);
    auto message = std::make_shared<Message>(t.data(), t.nbytes(), device_);
    message->ready.record(o.stream);
    const P2PKey key{rank_, peer, tag};
    {
      std::lock_guard lock(team_->p2p_mutex);
      team_->sent[key].push_back(message);
    }
    team_->p2p_changed.notify_all();
    return std::make_shared<SendWork>(team_, key, std::move(message));
  }

  std::shared_ptr<WorkImpl> recv(const TensorView& t, int peer, int tag,
                                 const Stream& stream) override {
    Op o(*this, stream);
    const P2PKey key{peer, rank_, tag};
    std::unique_lock lock(team_->p2p_mutex);
    auto& queue = team_->sent[key];
    MESHFUSE_CHECK(
        team_->p2p_changed.wait_until(lock, timeout_.from_now(), [&] { return !queue.empty(); }),
        ErrorCode::Timeout, "local: no matching send from rank {} (tag {}) arrived", peer, tag);
    const std::shared_ptr<Message> message = std::move(queue.front());
    queue.pop_front();
    message->taken = true;
    // The sender learns of the outcome (a copy queued, or a mismatch) once this scope ends.
    struct Notify {
      std::condition_variable& changed;
      ~Notify() { changed.notify_all(); }
    } notify{team_->p2p_changed};
    MESHFUSE_CHECK(message->bytes == t.nbytes(), ErrorCode::CommunicationFailure,
                   "local: a recv of {} bytes matched a send of {} bytes", t.nbytes(),
                   message->bytes);
    check_cuda(cudaStreamWaitEvent(o.stream, message->ready.get(), 0), "cudaStreamWaitEvent");
    if (message->device != device_) enable_peer_access(device_, message->device);
    copy_from(o, t.data(), message->device, message->data, t.nbytes());
    auto consumed = std::make_shared<Event>(device_);
    consumed->record(o.stream);
    message->consumed = consumed;
    return std::make_shared<EventWork>(std::move(consumed));
  }

  std::shared_ptr<WorkImpl> barrier(const Stream& stream) override {
    Op o(*this, stream);
    step(o, Post{});
    return record(o);
  }

  void abort() override { team_->ops.abort(); }
  void check_device(const Device& device) override { bind(device); }

 private:
  // One operation: its device made current and checked against this rank's.
  struct Op {
    Op(LocalCudaComm& comm, const Stream& stream)
        : guard(comm.bind(stream.device)), stream(native(stream)) {}
    cuda::DeviceGuard guard;
    cudaStream_t stream;
  };

  // This rank's device is that of its first CUDA operation, and every later one must be on it
  // too (as an NCCL communicator's): its events belong to it.
  int bind(const Device& device) {
    if (device_ < 0) {
      check_cuda_device(device, "local");
      events_[0] = std::make_unique<Event>(device.index);
      events_[1] = std::make_unique<Event>(device.index);
      device_ = device.index;
    }
    MESHFUSE_CHECK(device.index == device_, ErrorCode::DeviceMismatch,
                   "local: rank {}'s CUDA operations run on cuda:{} (the device of its first), "
                   "but the tensors are on {}",
                   rank_, device_, device.str());
    return device_;
  }

  // One step (see the top of this file): records this rank's next event, posts it with `mine`,
  // and makes the stream wait on every peer's. Returns every rank's post.
  std::vector<Post> step(Op& o, Post mine) {
    const Event& event = *events_[turn_];
    event.record(o.stream);
    mine.event = event.get();
    mine.device = device_;
    posts_[turn_] = mine;
    const Post* slot = &posts_[turn_];
    turn_ ^= 1;
    const auto all = team_->ops.meet(rank_, slot, timeout_.from_now());
    std::vector<Post> posts;
    for (int s = 0; s < size_; ++s) {
      posts.push_back(*static_cast<const Post*>(all[s]));
      if (s == rank_) continue;
      check_cuda(cudaStreamWaitEvent(o.stream, posts[s].event, 0), "cudaStreamWaitEvent");
      if (posts[s].device != device_ && !peer_ready_[s])
        peer_ready_[s] = enable_peer_access(device_, posts[s].device) ? 1 : 2;
    }
    return posts;
  }

  // The last step: the peers have read this rank's buffers once the stream passes it.
  std::shared_ptr<WorkImpl> finish(Op& o) {
    step(o, Post{});
    return record(o);
  }

  std::shared_ptr<WorkImpl> record(Op& o) {
    auto done = std::make_shared<Event>(device_);
    done->record(o.stream);
    return std::make_shared<EventWork>(std::move(done));
  }

  // The reduction kernel takes the peers' addresses as its parameters (every rank of the team
  // fails here alike, before any step).
  void check_reducible_team(std::string_view op) const {
    MESHFUSE_CHECK(size_ <= kMaxLocalReduceSources, ErrorCode::Unsupported,
                   "local: {} on CUDA tensors reduces over at most {} ranks, this team has {}", op,
                   kMaxLocalReduceSources, size_);
  }

  // Rank s's posted buffer, for a kernel here to read: on this device, or on one that peer access
  // reaches.
  const std::uint8_t* readable(const std::vector<Post>& posts, int s, std::string_view op) const {
    MESHFUSE_CHECK(posts[s].device == device_ || peer_ready_[s] == 1, ErrorCode::BackendUnavailable,
                   "local: {} reads rank {}'s tensors on cuda:{} from cuda:{}, but the two devices "
                   "have no peer access",
                   op, s, posts[s].device, device_);
    return posts[s].data;
  }

  void copy(const Op& o, std::uint8_t* dst, const Post& from, const std::uint8_t* src,
            std::size_t bytes) const {
    copy_from(o, dst, from.device, src, bytes);
  }

  // A copy into this rank's memory, on the copy engines: from this device, or from a peer's.
  void copy_from(const Op& o, void* dst, int src_device, const void* src, std::size_t bytes) const {
    if (bytes == 0 || dst == src) return;
    if (src_device == device_)
      check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, o.stream),
                 "cudaMemcpyAsync");
    else
      check_cuda(cudaMemcpyPeerAsync(dst, device_, src, src_device, bytes, o.stream),
                 "cudaMemcpyPeerAsync");
  }

  // all_reduce (root < 0: into every rank's tensor) and reduce (into root's): rank r reduces chunk
  // r of every tensor into a scratch; after the middle step the ranks copy the chunks they keep
  // from the scratches. Each element is reduced once, so every rank gets the same bits. Chunks
  // start at multiples of 16 bytes, so that the kernel's loads stay aligned.
  std::shared_ptr<WorkImpl> reduce_in_place(const TensorView& t, ReduceOp op, int root,
                                            const Stream& stream) {
    check_reducible_team(root < 0 ? "all_reduce" : "reduce");
    Op o(*this, stream);
    const std::size_t es = element_size(t.dtype());
    const std::int64_t n = t.numel();
    const std::int64_t align = std::max<std::int64_t>(1, 16 / static_cast<std::int64_t>(es));
    auto begin = [&](int r) { return r == size_ ? n : n * r / size_ / align * align; };
    const std::int64_t mine = begin(rank_ + 1) - begin(rank_);
    const auto inputs = step(o, Post{nullptr, 0, bytes_of(t)});
    std::vector<const void*> srcs;
    for (int s = 0; s < size_; ++s)
      srcs.push_back(readable(inputs, s, root < 0 ? "all_reduce" : "reduce") + begin(rank_) * es);
    // Freed on this stream when the operation returns, after the last step's waits.
    const std::shared_ptr<void> scratch =
        cuda_allocate(Device{DeviceType::CUDA, device_}, mine * es, stream);
    cuda_reduce_buffers(t.dtype(), op, srcs, scratch.get(), mine, stream);
    const auto reduced = step(o, Post{nullptr, 0, static_cast<const std::uint8_t*>(scratch.get())});
    if (root < 0 || root == rank_)
      for (int s = 0; s < size_; ++s)
        copy(o, bytes_of(t) + begin(s) * es, reduced[s], reduced[s].data,
             (begin(s + 1) - begin(s)) * es);
    return finish(o);
  }

  int rank_, size_;
  BackendTimeout timeout_;
  std::shared_ptr<LocalCudaTeam> team_;
  int device_ = -1;                   // bound by the first operation
  std::unique_ptr<Event> events_[2];  // used in turn, see the top of this file
  Post posts_[2];                     // what each of them was posted with
  int turn_ = 0;
  std::vector<char> peer_ready_;  // by team rank: 0 unknown, 1 peer access, 2 none
};

}  // namespace

std::shared_ptr<LocalCudaTeam> make_local_cuda_team(int size) {
  return std::make_shared<LocalCudaTeam>(size);
}

void abort_local_cuda_team(LocalCudaTeam& team, const std::string& why) { team.ops.abort(why); }

std::unique_ptr<CommImpl> make_local_cuda_comm(const TeamContext& context,
                                               std::shared_ptr<LocalCudaTeam> team) {
  return std::make_unique<LocalCudaComm>(context, std::move(team));
}

}  // namespace meshfuse::detail

#else  // !MESHFUSE_WITH_CUDA

namespace meshfuse::detail {

struct LocalCudaTeam {};

std::shared_ptr<LocalCudaTeam> make_local_cuda_team(int) {
  fail(ErrorCode::BackendUnavailable,
       "communicator backend local: CUDA tensors need a CUDA build (-DMESHFUSE_CUDA=ON)");
}

std::unique_ptr<CommImpl> make_local_cuda_comm(const TeamContext&, std::shared_ptr<LocalCudaTeam>) {
  fail(ErrorCode::BackendUnavailable,
       "communicator backend local: CUDA tensors need a CUDA build (-DMESHFUSE_CUDA=ON)");
}

void abort_local_cuda_team(LocalCudaTeam&, const std::string&) {}  // never made without CUDA

}  // namespace meshfuse::detail

#endif  // MESHFUSE_WITH_CUDA
