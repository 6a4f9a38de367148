// The local backend: the ranks are threads of one process and copy through shared memory.
//
// A collective is a few "meetings" of the team: every rank posts a pointer to its arguments and
// waits until all have (a barrier that also hands out the pointers), then reads what it needs
// from the others' buffers and writes only its own, and meets again before it returns, so no
// rank reuses a buffer that another still reads. In-place reductions are split in one chunk
// per rank: each rank reduces its chunk into a scratch, the team meets, and each writes its chunk
// back. Collectives run on one worker thread per rank (asynchronous, in call order); exchange()
// and send/recv run on the calling thread. Operations on CUDA tensors go to local_cuda.cpp, which
// queues them on the caller's stream from the calling thread.
#include "distributed/local.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "distributed/comm_impl.h"
#include "distributed/reduce.h"
#include "meshfuse/core/error.h"

namespace meshfuse::detail {

namespace {

// A receive waiting for its send.
struct PendingRecv {
  PendingRecv(void* data, std::size_t bytes) : data(data), bytes(bytes) {}
  void* data;
  std::size_t bytes;
  bool done = false;
  ErrorCode code = ErrorCode::CommunicationFailure;
  std::string error;  // empty: received
};

}  // namespace

struct LocalTeam {
  explicit LocalTeam(std::vector<int> members)
      : size(static_cast<int>(members.size())),
        members(std::move(members)),
        ops(size),
        checks(size) {}

  // The CUDA side's meeting point, made by the first rank that queues a CUDA operation.
  std::shared_ptr<LocalCudaTeam> cuda_team() {
    std::lock_guard lock(cuda_mutex);
    if (!cuda) {
      cuda = make_local_cuda_team(size);
      std::lock_guard p2p(p2p_mutex);
      if (!aborted.empty()) abort_local_cuda_team(*cuda, aborted);  // made after abort()
    }
    return cuda;
  }

  const int size;
  const std::vector<int> members;  // world ranks

  Meeting ops;     // collectives (worker threads)
  Meeting checks;  // exchange() (calling threads)

  // Point to point, keyed by (source, destination, tag): sends not yet received (copied, so a
  // send completes at once and ring exchanges cannot deadlock), and receives not yet matched.
  std::mutex p2p_mutex;
  std::condition_variable p2p_changed;
  using Key = std::tuple<int, int, int>;
  std::map<Key, std::deque<std::vector<std::uint8_t>>> sent;
  std::map<Key, std::deque<std::shared_ptr<PendingRecv>>> waiting;

  std::mutex cuda_mutex;
  std::shared_ptr<LocalCudaTeam> cuda;

  std::string aborted;  // under p2p_mutex: why abort() broke the team; empty while it has not
  std::map<int, std::string> returned;  // under p2p_mutex: team ranks that returned, and why

  void abort(const std::string& why) {
    ops.abort(why);
    checks.abort(why);
    {
      std::lock_guard lock(p2p_mutex);
      if (aborted.empty()) aborted = why;
    }
    p2p_changed.notify_all();
    std::lock_guard lock(cuda_mutex);
    if (cuda) abort_local_cuda_team(*cuda, why);
  }

  // A member that will call no more (CPU tensors): the collectives fail, as they need every
  // member, and so do receives from it that no send it made matches; other pairs go on.
  void member_returned(int team_rank, const std::string& why) {
    ops.abort(why);
    checks.abort(why);
    {
      std::lock_guard lock(p2p_mutex);
      returned.emplace(team_rank, why);
    }
    p2p_changed.notify_all();
  }
};

namespace {

// Where each rank's arguments are, for the others to read, and the call (operation, root, sizes) by
// which it reads the others' (which must agree on every rank: LocalComm::check_sizes).
struct Args {
  explicit Args(const void* in = nullptr, std::string sizes = {},
                std::vector<std::int64_t> in_counts = {}, std::vector<std::int64_t> out_counts = {})
      : in(static_cast<const std::uint8_t*>(in)),
        sizes(std::move(sizes)),
        in_counts(std::move(in_counts)),
        out_counts(std::move(out_counts)) {}

  const std::uint8_t* in;
  std::string sizes;
  std::vector<std::int64_t> in_counts, out_counts;  // all_to_all
};

std::string elements(std::string_view op, const TensorView& t) {
  return fmt::format("{} {} x {}", op, to_string(t.dtype()), t.numel());
}

std::string bytes(std::string_view op, int root, std::size_t n) {
  return fmt::format("{} root {}, {} bytes", op, root, n);
}

std::string counted(std::string_view op, DType dtype, const std::vector<std::int64_t>& counts) {
  return fmt::format("{} {} counts [{}]", op, to_string(dtype), fmt::join(counts, ", "));
}

std::vector<std::int64_t> offsets(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> off(counts.size() + 1, 0);
  for (std::size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

const Args& args_of(const std::vector<const void*>& all, int r) {
  return *static_cast<const Args*>(all[r]);
}

class RecvWork : public WorkImpl {
 public:
  RecvWork(std::shared_ptr<LocalTeam> team, LocalTeam::Key key, std::shared_ptr<PendingRecv> p)
      : team_(std::move(team)), key_(key), pending_(std::move(p)) {}

  bool test() override {
    std::lock_guard lock(team_->p2p_mutex);
    return pending_->done;
  }

  void wait(Deadline deadline) override {
    std::unique_lock lock(team_->p2p_mutex);
    const auto broken = [&]() -> const std::string* {
      if (!team_->aborted.empty()) return &team_->aborted;
      const auto it = team_->returned.find(std::get<0>(key_));  // the sender
      return it == team_->returned.end() ? nullptr : &it->second;
    };
    if (!team_->p2p_changed.wait_until(lock, deadline,
                                       [&] { return pending_->done || broken(); }) ||
        !pending_->done) {
      // Withdraw, so that a late send does not write into a buffer nobody waits for.
      auto& queue = team_->waiting[key_];
      queue.erase(std::find(queue.begin(), queue.end(), pending_));
      pending_->done = true;
      const std::string* why = broken();
      pending_->code = why ? ErrorCode::CommunicationFailure : ErrorCode::Timeout;
      pending_->error = why ? "local: " + *why : "local: no matching send arrived";
    }
    if (!pending_->error.empty()) throw Error(pending_->code, pending_->error);
  }

 private:
  std::shared_ptr<LocalTeam> team_;
  LocalTeam::Key key_;
  std::shared_ptr<PendingRecv> pending_;
};

class LocalComm : public CommImpl {
 public:
  LocalComm(const TeamContext& context, std::shared_ptr<LocalTeam> team)
      : context_(context),
        rank_(context.rank),
        size_(static_cast<int>(context.team.size())),
        timeout_(context.timeout),
        team_(std::move(team)),
        queue_("local " + context.name) {}

  CommunicatorBackend backend() const override { return CommunicatorBackend::Local; }
  void set_timeout(std::chrono::milliseconds timeout) override {
    timeout_.set(timeout);
    context_.timeout = timeout;  // for the CUDA side made later
    if (cuda_) cuda_->set_timeout(timeout);
  }

  void exchange(const void* mine, void* all, std::size_t bytes, Deadline deadline) override {
    const auto ptrs = team_->checks.meet(rank_, mine, deadline);
    for (int r = 0; r < size_; ++r)
      std::memcpy(static_cast<std::uint8_t*>(all) + r * bytes, ptrs[r], bytes);
    team_->checks.meet(rank_, nullptr, deadline);
  }

  std::shared_ptr<WorkImpl> all_reduce(const TensorView& t, ReduceOp op,
                                       const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->all_reduce(t, op, stream);
    return reduce_chunks(t, op, -1);
  }

  std::shared_ptr<WorkImpl> reduce(const TensorView& t, int root, ReduceOp op,
                                   const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->reduce(t, root, op, stream);
    return reduce_chunks(t, op, root);
  }

  std::shared_ptr<WorkImpl> broadcast(const TensorView& t, int root,
                                      const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->broadcast(t, root, stream);
    return collective(Args(t.data(), bytes("broadcast", root, t.nbytes())),
                      [=, this](const std::vector<const void*>& all) {
                        if (rank_ != root) std::memcpy(t.data(), args_of(all, root).in, t.nbytes());
                      });
  }

  std::shared_ptr<WorkImpl> all_gather(const TensorView& in, const TensorView& out,
                                       const std::vector<std::int64_t>& counts,
                                       const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->all_gather(in, out, counts, stream);
    const std::size_t es = element_size(in.dtype());
    return collective(Args(in.data(), counted("all_gather", in.dtype(), counts)),
                      [=, this, off = offsets(counts)](const std::vector<const void*>& all) {
                        auto* dst = static_cast<std::uint8_t*>(out.data());
                        for (int s = 0; s < size_; ++s)
                          copy_bytes(dst + off[s] * es, args_of(all, s).in, counts[s] * es);
                      });
  }

  std::shared_ptr<WorkImpl> reduce_scatter(const TensorView& in, const TensorView& out,
                                           const std::vector<std::int64_t>& counts, ReduceOp op,
                                           const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->reduce_scatter(in, out, counts, op, stream);
    const std::size_t es = element_size(in.dtype());
    return collective(Args(in.data(), counted("reduce_scatter", in.dtype(), counts)),
                      [=, this, off = offsets(counts)](const std::vector<const void*>& all) {
                        std::vector<const void*> srcs;
                        for (int s = 0; s < size_; ++s)
                          srcs.push_back(args_of(all, s).in + off[rank_] * es);
                        reduce_buffers(in.dtype(), op, srcs, out.data(), counts[rank_]);
                      });
  }

  std::shared_ptr<WorkImpl> gather(const TensorView& in, const TensorView& out, int root,
                                   const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->gather(in, out, root, stream);
    return collective(Args(in.data(), bytes("gather", root, in.nbytes())),
                      [=, this](const std::vector<const void*>& all) {
                        if (rank_ != root) return;
                        auto* dst = static_cast<std::uint8_t*>(out.data());
                        for (int s = 0; s < size_; ++s)
                          copy_bytes(dst + s * in.nbytes(), args_of(all, s).in, in.nbytes());
                      });
  }

  std::shared_ptr<WorkImpl> scatter(const TensorView& in, const TensorView& out, int root,
                                    const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->scatter(in, out, root, stream);
    return collective(Args(in.data(), bytes("scatter", root, out.nbytes())),
                      [=, this](const std::vector<const void*>& all) {
                        copy_bytes(static_cast<std::uint8_t*>(out.data()),
                                   args_of(all, root).in + rank_ * out.nbytes(), out.nbytes());
                      });
  }

  std::shared_ptr<WorkImpl> all_to_all(const TensorView& in, const TensorView& out,
                                       const std::vector<std::int64_t>& in_counts,
                                       const std::vector<std::int64_t>& out_counts,
                                       const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream))
      return cuda->all_to_all(in, out, in_counts, out_counts, stream);
    const std::size_t es = element_size(in.dtype());
    return collective(
        Args(in.data(), fmt::format("all_to_all {}", to_string(in.dtype())), in_counts, out_counts),
        [=, this, out_off = offsets(out_counts)](const std::vector<const void*>& all) {
          auto* dst = static_cast<std::uint8_t*>(out.data());
          for (int s = 0; s < size_; ++s) {
            const Args& a = args_of(all, s);
            std::int64_t from = 0;  // where rank s's block for this rank starts
            for (int r = 0; r < rank_; ++r) from += a.in_counts[r];
            copy_bytes(dst + out_off[s] * es, a.in + from * es, out_counts[s] * es);
          }
        });
  }

  std::shared_ptr<WorkImpl> send(const TensorView& t, int peer, int tag,
                                 const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->send(t, peer, tag, stream);
    const auto* data = static_cast<const std::uint8_t*>(t.data());
    std::lock_guard lock(team_->p2p_mutex);
    const LocalTeam::Key key{rank_, peer, tag};
    auto& receivers = team_->waiting[key];
    if (receivers.empty()) {
      team_->sent[key].emplace_back(data, data + t.nbytes());
    } else {
      deliver(*receivers.front(), data, t.nbytes());
      receivers.pop_front();
      team_->p2p_changed.notify_all();
    }
    return completed_work();
  }

  std::shared_ptr<WorkImpl> recv(const TensorView& t, int peer, int tag,
                                 const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->recv(t, peer, tag, stream);
    std::lock_guard lock(team_->p2p_mutex);
    const LocalTeam::Key key{peer, rank_, tag};
    auto pending = std::make_shared<PendingRecv>(t.data(), t.nbytes());
    auto& messages = team_->sent[key];
    if (messages.empty()) {
      team_->waiting[key].push_back(pending);
    } else {
      deliver(*pending, messages.front().data(), messages.front().size());
      messages.pop_front();
    }
    return std::make_shared<RecvWork>(team_, key, pending);
  }

  std::shared_ptr<WorkImpl> barrier(const Stream& stream) override {
    if (CommImpl* cuda = cuda_for(stream)) return cuda->barrier(stream);
    return collective(Args(nullptr, "barrier"), [](const std::vector<const void*>&) {});
  }

  void abort() override {
    team_->ops.abort();
    team_->checks.abort();
    if (cuda_) cuda_->abort();
  }

  void check_device(const Device& device) override {
    if (CommImpl* cuda = cuda_for(Stream{device})) cuda->check_device(device);
  }

 private:
  // The CUDA side for operations on a CUDA stream (the tensors' device), set up on first use;
  // nullptr for CPU ones.
  CommImpl* cuda_for(const Stream& stream) {
    if (stream.device.type != DeviceType::CUDA) return nullptr;
    if (!cuda_) cuda_ = make_local_cuda_comm(context_, team_->cuda_team());
    return cuda_.get();
  }

  static void copy_bytes(std::uint8_t* dst, const std::uint8_t* src, std::size_t n) {
    if (dst != src && n > 0) std::memcpy(dst, src, n);
  }

  static void deliver(PendingRecv& r, const std::uint8_t* data, std::size_t bytes) {
    if (bytes == r.bytes)
      copy_bytes(static_cast<std::uint8_t*>(r.data), data, bytes);  // an empty one may be null
    else
      r.error = fmt::format("local: a recv of {} bytes matched a send of {} bytes", r.bytes, bytes);
    r.done = true;
  }

  // With the checks off (set_checks(false)) no exchange compared the calls before they met, and
  // each rank reads the others' buffers by its own sizes: sizes that differ are refused here, by
  // every rank alike (each sees every call), before a buffer is read; after one more meeting, as
  // the others may still be reading this rank's Args.
  void check_sizes(const std::vector<const void*>& all) {
    const std::string why = disagreement(all);
    if (why.empty()) return;
    team_->ops.meet(rank_, nullptr, timeout_.from_now());
    throw Error(ErrorCode::InvalidArgument,
                why +
                    " (with the checks off, set_checks(false), nothing compared the calls before "
                    "they met)");
  }

  std::string disagreement(const std::vector<const void*>& all) const {
    const Args& first = args_of(all, 0);
    for (int s = 1; s < size_; ++s)
      if (args_of(all, s).sizes != first.sizes)
        return fmt::format("local: ranks disagree: rank 0 has {} but rank {} has {}", first.sizes,
                           s, args_of(all, s).sizes);
    if (first.out_counts.empty()) return {};  // not all_to_all
    for (int s = 0; s < size_; ++s)
      for (int r = 0; r < size_; ++r) {
        const std::int64_t sent = args_of(all, s).in_counts[r],
                           expected = args_of(all, r).out_counts[s];
        if (sent != expected)
          return fmt::format(
              "local: all_to_all: rank {} sends {} elements to rank {}, which "
              "expects {}",
              s, sent, r, expected);
      }
    return {};
  }

  // Runs `body` between two meetings of the team, on this rank's worker.
  template <typename Body>
  std::shared_ptr<WorkImpl> collective(Args args, Body body) {
    return queue_.submit([this, args, body = std::move(body)] {
      const auto all = team_->ops.meet(rank_, &args, timeout_.from_now());
      check_sizes(all);
      body(all);
      team_->ops.meet(rank_, nullptr, timeout_.from_now());
    });
  }

  // all_reduce (root < 0: into every rank's tensor) and reduce (into root's): rank r reduces
  // chunk r of all tensors into a scratch, and writes it back once every rank has read.
  std::shared_ptr<WorkImpl> reduce_chunks(const TensorView& t, ReduceOp op, int root) {
    return queue_.submit([=, this] {
      const std::int64_t n = t.numel();
      const std::size_t es = element_size(t.dtype());
      const std::int64_t begin = n * rank_ / size_, end = n * (rank_ + 1) / size_;
      const Args args(t.data(), root < 0 ? elements("all_reduce", t)
                                         : elements(fmt::format("reduce root {}", root), t));
      const auto all = team_->ops.meet(rank_, &args, timeout_.from_now());
      check_sizes(all);
      std::vector<const void*> srcs;
      for (int s = 0; s < size_; ++s) srcs.push_back(args_of(all, s).in + begin * es);
      std::vector<std::uint8_t> chunk((end - begin) * es);
      reduce_buffers(t.dtype(), op, srcs, chunk.data(), end - begin);
      team_->ops.meet(rank_, nullptr, timeout_.from_now());
      for (int s = 0; s < size_; ++s)
        if (root < 0 || s == root)
          copy_bytes(const_cast<std::uint8_t*>(args_of(all, s).in) + begin * es, chunk.data(),
                     chunk.size());
      team_->ops.meet(rank_, nullptr, timeout_.from_now());
    });
  }

  TeamContext context_;
  int rank_, size_;
  BackendTimeout timeout_;
  std::shared_ptr<LocalTeam> team_;
  std::unique_ptr<CommImpl> cuda_;
  WorkerQueue queue_;  // last: joined before the rest goes
};

}  // namespace

namespace {

std::string returned_why(int rank) {
  return fmt::format(
      "rank {} has returned from its run_local function: a collective or recv that needs it "
      "cannot complete",
      rank);
}

}  // namespace

std::unique_ptr<CommImpl> make_local_comm(const TeamContext& context) {
  MESHFUSE_CHECK(context.local != nullptr, ErrorCode::InvalidArgument,
                 "communicator backend local: only for the threads of a LocalWorld");
  LocalWorldState& world = *context.local;
  std::shared_ptr<LocalTeam> team;
  {
    std::lock_guard lock(world.mutex);
    std::weak_ptr<LocalTeam>& slot = world.teams[context.name];
    team = slot.lock();
    if (!team) {
      team = std::make_shared<LocalTeam>(context.team);
      slot = team;
      if (!world.aborted.empty()) team->abort(world.aborted);
      for (std::size_t r = 0; r < context.team.size(); ++r)
        if (world.returned[static_cast<std::size_t>(context.team[r])])
          team->member_returned(static_cast<int>(r), returned_why(context.team[r]));
    }
  }
  return std::make_unique<LocalComm>(context, std::move(team));
}

void local_rank_returned(LocalWorldState& world, int rank) {
  std::vector<std::pair<std::shared_ptr<LocalTeam>, int>> teams;  // with the rank's team rank
  {
    std::lock_guard lock(world.mutex);
    world.returned[static_cast<std::size_t>(rank)] = true;
    for (const auto& [name, slot] : world.teams)
      if (auto team = slot.lock()) {
        const auto at = std::find(team->members.begin(), team->members.end(), rank);
        if (at != team->members.end())
          teams.emplace_back(std::move(team), static_cast<int>(at - team->members.begin()));
      }
  }
  for (const auto& [team, team_rank] : teams) team->member_returned(team_rank, returned_why(rank));
}

void abort_local_world(LocalWorldState& world, const std::string& why) {
  std::vector<std::shared_ptr<LocalTeam>> teams;
  {
    std::lock_guard lock(world.mutex);
    if (world.aborted.empty()) world.aborted = why;
    for (const auto& [name, slot] : world.teams)
      if (auto team = slot.lock()) teams.push_back(std::move(team));
  }
  for (const auto& team : teams) team->abort(why);
}

}  // namespace meshfuse::detail
