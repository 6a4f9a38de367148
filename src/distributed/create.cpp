// Creating communicators: init_communicator (a process of a launched job), LocalWorld and
// run_local (ranks as threads of one process).
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "distributed/comm_state.h"
#include "distributed/local.h"
#include "meshfuse/core/error.h"
#include "meshfuse/distributed/bootstrap.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse {

using detail::CommState;

namespace {

std::vector<int> iota_ranks(int n) {
  std::vector<int> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

std::unique_ptr<CommState> world_state(const LaunchInfo& launch, BackendSpec spec,
                                       const CommOptions& options) {
  auto s = std::make_unique<CommState>();
  s->team = iota_ranks(launch.world_size);
  s->rank = launch.rank;
  s->spec = std::move(spec);
  s->launch = launch;
  s->name = "world";
  s->timeout = options.timeout;
  s->check = options.check;
  s->history_size = options.history;
  return s;
}

}  // namespace

std::shared_ptr<Communicator> init_communicator(const CommOptions& given) {
  detail::check_timeout(given.timeout, "init_communicator");
  CommOptions options = given;
  if (const char* env = std::getenv("MESHFUSE_BACKEND"); options.backend.empty() && env)
    options.backend = env;
  const LaunchInfo launch = launch_info_from_env();
  // One rendezvous per job: a second one beside a live first would serve the same port (rank 0
  // cannot bind it) and read the first one's keys (the others connected to its peers' stale
  // addresses and could wait the whole timeout there).
  static std::mutex joined_mutex;
  static std::weak_ptr<Store> joined;  // the store of this process's last init_communicator
  std::lock_guard lock(joined_mutex);
  MESHFUSE_CHECK(joined.expired(), ErrorCode::InvalidArgument,
                 "init_communicator: this process ({}) has already joined its job, and that "
                 "communicator (or one split from it) is alive; use it (split, new_group and "
                 "with_backends make more) instead of a second rendezvous",
                 launch.str());
  std::shared_ptr<Store> store = store_from_env(launch, options.timeout);
  joined = store;
  // A process started without a launcher and without a backend named is a world of one thread.
  if (options.backend.empty() && launch.world_size == 1 && !store) {
    LocalWorld world(1, options);
    return world.communicator(0);
  }
  return init_communicator(launch, std::move(store), options);
}

std::shared_ptr<Communicator> init_communicator(const LaunchInfo& launch,
                                                std::shared_ptr<Store> store,
                                                const CommOptions& options) {
  BackendSpec spec = BackendSpec::parse(options.backend);
  for (const auto& [device, backend] : spec.backends)
    MESHFUSE_CHECK(backend != CommunicatorBackend::Local, ErrorCode::InvalidArgument,
                   "init_communicator: the local backend runs ranks as threads of one process; "
                   "use LocalWorld or run_local");
  auto state = world_state(launch, std::move(spec), options);
  state->store = std::move(store);
  // CPU backends rendezvous now, so set-up errors show at start; others on first use.
  const bool has_cpu = state->spec.backends.count(DeviceType::CPU) > 0;
  CommState& s = *state;
  auto comm = CommState::make(std::move(state));
  if (has_cpu) s.impl(s.spec.backends.at(DeviceType::CPU));
  return comm;
}

LocalWorld::LocalWorld(int size, const CommOptions& options) : size_(size), options_(options) {
  MESHFUSE_CHECK(size >= 1, ErrorCode::InvalidArgument, "LocalWorld: size {} is not positive",
                 size);
  detail::check_timeout(options.timeout, "LocalWorld");
  spec_ = BackendSpec::parse(options.backend.empty() ? "local" : options.backend);
  for (const auto& [device, backend] : spec_.backends)
    MESHFUSE_CHECK(backend == CommunicatorBackend::Local, ErrorCode::InvalidArgument,
                   "LocalWorld: backend '{}' is not local", options.backend);
  state_ = std::make_shared<detail::LocalWorldState>(size);
}

LocalWorld::~LocalWorld() = default;

std::shared_ptr<Communicator> LocalWorld::communicator(int rank) {
  MESHFUSE_CHECK(rank >= 0 && rank < size_, ErrorCode::InvalidArgument,
                 "LocalWorld: rank {} is outside 0..{}", rank, size_ - 1);
  {
    std::lock_guard lock(state_->mutex);
    MESHFUSE_CHECK(!state_->taken[rank], ErrorCode::InvalidArgument,
                   "LocalWorld: rank {}'s communicator was already taken", rank);
    state_->taken[rank] = true;
  }
  LaunchInfo launch;
  launch.rank = launch.local_rank = rank;
  launch.world_size = launch.local_world_size = size_;
  auto state = world_state(launch, spec_, options_);
  state->store = state_->store;
  state->local = state_;
  return CommState::make(std::move(state));
}

void LocalWorld::abort(const std::string& why) { detail::abort_local_world(*state_, why); }

void LocalWorld::rank_returned(int rank) {
  MESHFUSE_CHECK(rank >= 0 && rank < size_, ErrorCode::InvalidArgument,
                 "LocalWorld: rank {} is outside 0..{}", rank, size_ - 1);
  detail::local_rank_returned(*state_, rank);
}

void run_local(int size, const std::function<void(const std::shared_ptr<Communicator>&)>& fn,
               const CommOptions& options, const std::function<void()>& poll) {
  LocalWorld world(size, options);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(world.communicator(r));
  std::mutex mutex;
  std::condition_variable finished;
  int running = size;
  std::exception_ptr first;  // the others' errors are most likely its consequences
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(comms[r]);
        world.rank_returned(r);
      } catch (...) {
        std::string what = "an exception that is not a std::exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        {
          const std::lock_guard lock(mutex);
          if (!first) first = std::current_exception();
        }
        world.abort(fmt::format("rank {} of run_local raised: {}", r, what));
      }
      const std::lock_guard lock(mutex);
      if (--running == 0) finished.notify_all();
    });
  std::exception_ptr polled;
  if (poll) {
    std::unique_lock lock(mutex);
    while (!finished.wait_for(lock, std::chrono::milliseconds(100), [&] { return running == 0; })) {
      lock.unlock();
      try {
        poll();
      } catch (...) {
        polled = std::current_exception();
        world.abort("run_local was interrupted");
        break;
      }
      lock.lock();
    }
  }
  for (std::thread& t : threads) t.join();
  if (polled) std::rethrow_exception(polled);
  if (first) std::rethrow_exception(first);
}

void run_local(int size, const std::function<void(Communicator&)>& fn, const CommOptions& options) {
  run_local(
      size, [&](const std::shared_ptr<Communicator>& comm) { fn(*comm); }, options);
}

}  // namespace meshfuse
