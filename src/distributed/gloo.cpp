// The gloo backend: Gloo's collectives over its TCP transport, a full mesh of connections per
// team set up through the team's store.
//
// Gloo moves bytes; meshfuse gives it the element width (an unsigned integer of the dtype's size)
// and does the arithmetic itself (reduce.h), so every dtype reduces, bf16 and f16 in fp32 per
// pairwise step of Gloo's ring. reduce_scatter, which this Gloo has only for float types in its
// old API, is an all_to_all of the blocks followed by a local reduction of the team's blocks (the
// same bytes on the wire as a ring, reduced in fp32 and rounded once). Avg = sum, then divide.
//
// Collectives run in call order on one worker thread per team (Gloo's calls block); send and
// recv are posted from the calling thread (Gloo's unbound buffers are asynchronous) and a small
// thread per message waits for its completion. Gloo cannot cancel an operation: after a timeout
// in Work::wait shorter than the team's, the worker finishes (or times out) on Gloo's own clock,
// and destroying the communicator waits for it.
//
// Address: GLOO_SOCKET_IFNAME (as in PyTorch) names the interface; otherwise 127.0.0.1 when every
// rank is on this machine, else this machine's hostname.
#include "distributed/comm_impl.h"
#include "meshfuse/core/error.h"

#ifdef MESHFUSE_WITH_GLOO

#include <arpa/inet.h>
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "distributed/reduce.h"

namespace meshfuse::detail {

namespace {

// Gloo's rendezvous reads and writes through this view of the team's store.
class StoreForGloo : public gloo::rendezvous::Store {
 public:
  explicit StoreForGloo(std::shared_ptr<meshfuse::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, meshfuse::Store::Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const meshfuse::Store::Bytes v = store_->get(key);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<meshfuse::Store> store_;
};

// Gloo's exceptions as meshfuse errors: its timeouts say "Timed out", or "Connect timeout",
// "Read timeout", "Write timeout" in its transport; its enforce failures and the system errors of
// its set-up are not gloo::Exceptions.
template <typename F>
void as_errors(F&& f) {
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const bool timeout =
        what.find("Timed out") != std::string::npos || what.find("timeout") != std::string::npos;
    throw Error(timeout ? ErrorCode::Timeout : ErrorCode::CommunicationFailure, "gloo: " + what);
  }
}

// Calls f(W{}) with W an unsigned integer as wide as one element of `dtype`.
template <typename F>
void with_word(DType dtype, F&& f) {
  switch (element_size(dtype)) {
    case 1:
      return f(std::uint8_t{});
    case 2:
      return f(std::uint16_t{});
    case 4:
      return f(std::uint32_t{});
    default:
      return f(std::uint64_t{});
  }
}

std::vector<std::size_t> as_sizes(const std::vector<std::int64_t>& v) {
  return {v.begin(), v.end()};
}

bool resolves_to_loopback(const char* host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host, nullptr, &hints, &found) != 0 || !found) return false;
  const auto* a = reinterpret_cast<const sockaddr_in*>(found->ai_addr);
  const bool loopback = (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  ::freeaddrinfo(found);
  return loopback;
}

// One TCP device per process, shared by every team's context (each device runs a thread).
std::shared_ptr<gloo::transport::Device> shared_device(const LaunchInfo& launch) {
  static std::mutex mutex;
  static std::weak_ptr<gloo::transport::Device> cached;
  std::lock_guard lock(mutex);
  if (auto device = cached.lock()) return device;
  // Gloo writes with writev, which raises SIGPIPE once a peer has died; its default action
  // would kill this rank instead of letting Gloo report the broken pair as an error. A
  // handler the program installed itself is left alone (Python already ignores SIGPIPE).
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
  gloo::transport::tcp::attr attr;
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
    attr.iface = iface;
  } else if (launch.local_world_size == launch.world_size) {
    attr.hostname = "127.0.0.1";
  } else {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    attr.hostname = host;
    // Debian maps the host's own name to 127.0.1.1: ranks on other hosts could not reach it, and
    // those waiting for their connections would wait five timeouts in Gloo.
    MESHFUSE_CHECK(!resolves_to_loopback(host), ErrorCode::InvalidArgument,
                   "communicator backend gloo: this host's name '{}' resolves to a loopback "
                   "address, which the job's ranks on other hosts ({} ranks, {} here) cannot "
                   "reach: set GLOO_SOCKET_IFNAME to the network interface to use (e.g. eth0)",
                   host, launch.world_size, launch.local_world_size);
  }
  std::shared_ptr<gloo::transport::Device> device;
  as_errors([&] { device = gloo::transport::tcp::CreateDevice(attr); });
  cached = device;
  return device;
}

// A send or receive: a thread waits for Gloo to complete it. A work dropped in flight leaves that
// thread running with the buffer until Gloo is done with it (the message, or Gloo's own timeout,
// which closes the team's connections): freed while posted, the buffer wedged the pair once the
// peer's message came, and spun Gloo's I/O thread. `dropped` counts the communicator's works so
// left running (~GlooComm).
class P2pWork : public WorkImpl {
 public:
  P2pWork(std::unique_ptr<gloo::transport::UnboundBuffer> buffer, bool is_send,
          std::chrono::milliseconds timeout, std::shared_ptr<std::atomic<int>> dropped)
      : state_(std::make_shared<State>()) {
    state_->buffer = std::move(buffer);
    state_->dropped = std::move(dropped);
    waiter_ = std::thread([s = state_, is_send, timeout] {
      std::exception_ptr error;
      try {
        as_errors([&] { is_send ? s->buffer->waitSend(timeout) : s->buffer->waitRecv(timeout); });
      } catch (const Error& e) {
        error = e.code() != ErrorCode::Timeout
                    ? std::current_exception()
                    : std::make_exception_ptr(
                          Error(e.code(), e.message() + " (if the peer did post its send: gloo "
                                                        "pairs a send only with a recv of the same "
                                                        "tag and byte count)"));
      } catch (...) {
        error = std::current_exception();
      }
      s->done.finish(error);
      if (s->released.exchange(true)) --*s->dropped;  // the work was dropped before this
    });
  }
  bool test() override { return state_->done.test(); }
  void wait(Deadline deadline) override { state_->done.wait(deadline); }
  ~P2pWork() override {
    ++*state_->dropped;
    if (state_->released.exchange(true)) {  // the waiter has ended
      --*state_->dropped;
      waiter_.join();
    } else {
      waiter_.detach();
    }
  }

 private:
  struct State {
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    TaskWork done;
    std::atomic<bool> released{false};  // set by the first of the waiter's end and the work's
    std::shared_ptr<std::atomic<int>> dropped;
  };
  std::shared_ptr<State> state_;
  std::thread waiter_;
};

class GlooComm : public CommImpl {
 public:
  explicit GlooComm(const TeamContext& context)
      : size_(static_cast<int>(context.team.size())),
        timeout_(context.timeout),
        queue_("gloo " + context.name) {
    MESHFUSE_CHECK(context.store != nullptr, ErrorCode::InvalidArgument,
                   "communicator backend gloo: needs a rendezvous store (MASTER_ADDR and "
                   "MASTER_PORT, or MESHFUSE_STORE_PATH)");
    auto device = shared_device(context.launch);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(context.rank, size_);
    ctx->setTimeout(timeout_.get());
    StoreForGloo store(context.store);
    as_errors([&] { ctx->connectFullMesh(store, device); });
    context_ = std::move(ctx);
  }

  // The queued operations run first. A send or receive dropped in flight still has its buffer
  // posted (P2pWork): only then are the connections closed here, so that Gloo writes nothing into
  // its tensor once the communicator is gone (its waiter ends at Gloo's timeout). Otherwise Gloo's
  // own destructor closes them, sending what is still unsent, where this close would reset them.
  ~GlooComm() override {
    queue_.stop();
    if (*dropped_ > 0 && context_) try {
        context_->closeConnections();
      } catch (const std::exception&) {  // closing what is already broken
      }
  }

  CommunicatorBackend backend() const override { return CommunicatorBackend::Gloo; }
  void set_timeout(std::chrono::milliseconds timeout) override { timeout_.set(timeout); }
  // Gloo cannot stop a collective under way (it ends at its own timeout); those queued behind it
  // never start.
  void abort() override {
    queue_.abort("gloo: not run: the communicator was aborted after an earlier failure");
  }

  void exchange(const void* mine, void* all, std::size_t bytes, Deadline deadline) override {
    // The task owns its buffers: after a timeout here the caller's are gone, and the queued
    // allgather still runs (and may complete) later.
    const auto* p = static_cast<const std::uint8_t*>(mine);
    auto in = std::make_shared<std::vector<std::uint8_t>>(p, p + bytes);
    auto out = std::make_shared<std::vector<std::uint8_t>>(bytes * size_);
    queue_
        .submit([=, this] {
          gloo::AllgatherOptions opts(context_);
          opts.setInput(in->data(), bytes);
          opts.setOutput(out->data(), out->size());
          opts.setTimeout(timeout_.get());
          as_errors([&] { gloo::allgather(opts); });  // gloo's timeout as Error(Timeout)
        })
        ->wait(deadline);
    std::memcpy(all, out->data(), out->size());
  }

  std::shared_ptr<WorkImpl> all_reduce(const TensorView& t, ReduceOp op, const Stream&) override {
    return run([=, this] {
      with_word(t.dtype(), [&](auto w) {
        using W = decltype(w);
        gloo::AllreduceOptions opts(context_);
        opts.setOutput(t.data_ptr<W>(), static_cast<std::size_t>(t.numel()));
        opts.setReduceFunction(pairwise(t.dtype(), op));
        opts.setTimeout(timeout_.get());
        gloo::allreduce(opts);
      });
      if (op == ReduceOp::Avg) divide_buffer(t.dtype(), t.data(), t.numel(), size_);
    });
  }

  std::shared_ptr<WorkImpl> reduce(const TensorView& t, int root, ReduceOp op,
                                   const Stream&) override {
    return run([=, this] {
      with_word(t.dtype(), [&](auto w) {
        using W = decltype(w);
        // Gloo works in its output on every rank: other ranks keep their tensor as it was.
        const auto n = static_cast<std::size_t>(t.numel());
        std::vector<W> scratch(context_->rank == root ? 0 : n);
        gloo::ReduceOptions opts(context_);
        opts.setInput(t.data_ptr<W>(), n);
        opts.setOutput(context_->rank == root ? t.data_ptr<W>() : scratch.data(), n);
        opts.setRoot(root);
        opts.setReduceFunction(pairwise(t.dtype(), op));
        opts.setTimeout(timeout_.get());
        gloo::reduce(opts);
      });
      if (op == ReduceOp::Avg && context_->rank == root)
        divide_buffer(t.dtype(), t.data(), t.numel(), size_);
    });
  }

  std::shared_ptr<WorkImpl> broadcast(const TensorView& t, int root, const Stream&) override {
    return run([=, this] {
      with_word(t.dtype(), [&](auto w) {
        using W = decltype(w);
        gloo::BroadcastOptions opts(context_);
        opts.setOutput(t.data_ptr<W>(), static_cast<std::size_t>(t.numel()));
        opts.setRoot(root);
        opts.setTimeout(timeout_.get());
        gloo::broadcast(opts);
      });
    });
  }

  std::shared_ptr<WorkImpl> all_gather(const TensorView& in, const TensorView& out,
                                       const std::vector<std::int64_t>& counts,
                                       const Stream&) override {
    return run([=, this] {
      with_word(in.dtype(), [&](auto w) {
        using W = decltype(w);
        gloo::AllgathervOptions opts(context_);
        opts.setInput(in.data_ptr<W>(), static_cast<std::size_t>(in.numel()));
        opts.setOutput(out.data_ptr<W>(), as_sizes(counts));
        opts.setTimeout(timeout_.get());
        gloo::allgatherv(opts);
      });
    });
  }

  std::shared_ptr<WorkImpl> reduce_scatter(const TensorView& in, const TensorView& out,
                                           const std::vector<std::int64_t>& counts, ReduceOp op,
                                           const Stream&) override {
    return run([=, this] {
      // Block r of every rank's input goes to rank r, which reduces the team's blocks.
      const int me = context_->rank;
      const std::int64_t mine = counts[me];
      const std::size_t es = element_size(in.dtype());
      std::vector<std::uint8_t> blocks(static_cast<std::size_t>(mine * size_) * es);
      alltoallv(in, counts, blocks.data(), std::vector<std::int64_t>(size_, mine));
      std::vector<const void*> srcs;
      for (int r = 0; r < size_; ++r) srcs.push_back(blocks.data() + r * mine * es);
      reduce_buffers(in.dtype(), op, srcs, out.data(), mine);
    });
  }

  std::shared_ptr<WorkImpl> gather(const TensorView& in, const TensorView& out, int root,
                                   const Stream&) override {
    return run([=, this] {
      with_word(in.dtype(), [&](auto w) {
        using W = decltype(w);
        gloo::GatherOptions opts(context_);
        opts.setInput(in.data_ptr<W>(), static_cast<std::size_t>(in.numel()));
        if (context_->rank == root)
          opts.setOutput(out.data_ptr<W>(), static_cast<std::size_t>(out.numel()));
        opts.setRoot(root);
        opts.setTimeout(timeout_.get());
        gloo::gather(opts);
      });
    });
  }

  std::shared_ptr<WorkImpl> scatter(const TensorView& in, const TensorView& out, int root,
                                    const Stream&) override {
    return run([=, this] {
      with_word(out.dtype(), [&](auto w) {
        using W = decltype(w);
        gloo::ScatterOptions opts(context_);
        const auto n = static_cast<std::size_t>(out.numel());
        if (context_->rank == root) {
          std::vector<W*> blocks;
          for (int r = 0; r < size_; ++r) blocks.push_back(in.data_ptr<W>() + r * n);
          opts.setInputs(blocks, n);
        }
        opts.setOutput(out.data_ptr<W>(), n);
        opts.setRoot(root);
        opts.setTimeout(timeout_.get());
        gloo::scatter(opts);
      });
    });
  }

  std::shared_ptr<WorkImpl> all_to_all(const TensorView& in, const TensorView& out,
                                       const std::vector<std::int64_t>& in_counts,
                                       const std::vector<std::int64_t>& out_counts,
                                       const Stream&) override {
    return run([=, this] { alltoallv(in, in_counts, out.data(), out_counts); });
  }

  std::shared_ptr<WorkImpl> send(const TensorView& t, int peer, int tag, const Stream&) override {
    auto buffer = context_->createUnboundBuffer(t.data(), t.nbytes());
    as_errors([&] { buffer->send(peer, p2p_slot(tag, t.nbytes())); });
    return std::make_shared<P2pWork>(std::move(buffer), true, timeout_.get(), dropped_);
  }

  std::shared_ptr<WorkImpl> recv(const TensorView& t, int peer, int tag, const Stream&) override {
    auto buffer = context_->createUnboundBuffer(t.data(), t.nbytes());
    as_errors([&] { buffer->recv(peer, p2p_slot(tag, t.nbytes())); });
    return std::make_shared<P2pWork>(std::move(buffer), false, timeout_.get(), dropped_);
  }

  std::shared_ptr<WorkImpl> barrier(const Stream&) override {
    return run([this] {
      gloo::BarrierOptions opts(context_);
      opts.setTimeout(timeout_.get());
      gloo::barrier(opts);
    });
  }

 private:
  // Sends and receives use slots far from those of Gloo's collectives (small prefixes << 56), and
  // the slot holds 24 bits of a hash of the byte count besides the tag: Gloo pairs a send with
  // the recv of its slot, and a send larger than that recv's buffer aborts the process in Gloo's
  // thread (a smaller one leaves the rest of the buffer as it was). A recv of another size than
  // the send matches nothing and times out instead (P2pWork's error says why).
  static std::uint64_t p2p_slot(int tag, std::size_t bytes) {
    const std::uint64_t size_hash = (std::uint64_t{bytes} * 0x9E3779B97F4A7C15ull) >> 40;
    return (std::uint64_t{0xF0} << 56) | (size_hash << 32) | static_cast<std::uint32_t>(tag);
  }

  template <typename F>
  std::shared_ptr<WorkImpl> run(F&& f) {
    return queue_.submit([f = std::forward<F>(f)] { as_errors(f); });
  }

  // Gloo's reduction step c = a op b, on our element types (Avg sums; divided afterwards).
  static gloo::AllreduceOptions::Func pairwise(DType dtype, ReduceOp op) {
    const ReduceOp step = op == ReduceOp::Avg ? ReduceOp::Sum : op;
    return [dtype, step](void* c, const void* a, const void* b, std::size_t n) {
      reduce_buffers(dtype, step, {a, b}, c, static_cast<std::int64_t>(n));
    };
  }

  void alltoallv(const TensorView& in, const std::vector<std::int64_t>& in_counts, void* out,
                 const std::vector<std::int64_t>& out_counts) {
    with_word(in.dtype(), [&](auto w) {
      using W = decltype(w);
      gloo::AlltoallvOptions opts(context_);
      opts.setInput(in.data_ptr<W>(), in_counts);
      opts.setOutput(static_cast<W*>(out), out_counts);
      opts.setTimeout(timeout_.get());
      gloo::alltoallv(opts);
    });
  }

  int size_;
  BackendTimeout timeout_;
  std::shared_ptr<gloo::Context> context_;
  // Sends and receives dropped while Gloo still has their buffers posted (P2pWork).
  std::shared_ptr<std::atomic<int>> dropped_ = std::make_shared<std::atomic<int>>(0);
  WorkerQueue queue_;  // last: joined before the context goes
};

}  // namespace

std::unique_ptr<CommImpl> make_gloo_comm(const TeamContext& context) {
  return std::make_unique<GlooComm>(context);
}

}  // namespace meshfuse::detail

#else  // MESHFUSE_WITH_GLOO

namespace meshfuse::detail {

std::unique_ptr<CommImpl> make_gloo_comm(const TeamContext&) {
  fail(ErrorCode::BackendUnavailable,
       "communicator backend gloo: not in this build (install libgloo-dev and configure with "
       "-DMESHFUSE_GLOO=ON)");
}

}  // namespace meshfuse::detail

#endif  // MESHFUSE_WITH_GLOO
