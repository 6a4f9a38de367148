// The generic layer of every communicator: the state of a team (CommState: its backends, set up on
// first use, the rendezvous before them, the metadata exchange, the history and sub-teams) and the
// Communicator's accessors. The operations are in collectives.cpp, their checks and records in
// metadata_check.cpp and comm_record.cpp; backends only move bytes (comm_impl.h).
#include "meshfuse/distributed/communicator.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "distributed/comm_state.h"
#include "meshfuse/core/error.h"

namespace meshfuse {

namespace detail {

std::unique_ptr<CommState> CommState::child(std::vector<int> members, int new_rank,
                                            std::string child_name) const {
  auto c = std::make_unique<CommState>();
  c->team = std::move(members);
  c->rank = new_rank;
  c->spec = spec;
  c->launch = launch;
  c->store = store;
  c->local = local;
  c->name = std::move(child_name);
  c->timeout = timeout;
  c->check = check;
  c->history_size = history_size;
  return c;
}

CommImpl& CommState::impl(CommunicatorBackend backend) {
  auto it = impls.find(backend);
  if (it != impls.end()) return *it->second;
  TeamContext context;
  context.team = team;
  context.rank = rank;
  context.launch = launch;
  if (store)
    context.store =
        std::make_shared<PrefixStore>(name + "/" + std::string(to_string(backend)), store);
  context.timeout = timeout;
  context.name = name;
  context.local = local;
  context.bootstrap_exchange = [this, backend](const void* mine, void* all, std::size_t bytes) {
    bootstrap_exchange(backend, mine, all, bytes);
  };
  std::unique_ptr<CommImpl> created;
  try {
    switch (backend) {
      case CommunicatorBackend::Local:
        created = make_local_comm(context);
        break;
      case CommunicatorBackend::Gloo:
        created = make_gloo_comm(context);
        break;
      case CommunicatorBackend::Mpi:
        created = make_mpi_comm(context);
        break;
      case CommunicatorBackend::Nccl:
        created = make_nccl_comm(context);
        break;
    }
  } catch (const Error& e) {
    // A store's timeout names only a key: say whose set-up waited, and for what (once: NCCL's
    // set-up may exchange through another backend's, wrapped already).
    if (e.code() != ErrorCode::Timeout || e.message().starts_with("communicator ")) throw;
    fail(ErrorCode::Timeout,
         "communicator {}: the {} backend's set-up on rank {} of {} gave up waiting for its peers "
         "after {} ms (has every rank of the team started, with the same store?): {}",
         name, to_string(backend), rank, size(), timeout.count(), e.message());
  }
  return *impls.emplace(backend, std::move(created)).first->second;
}

void CommState::bootstrap_exchange(CommunicatorBackend backend, const void* mine, void* all,
                                   std::size_t bytes) {
  const std::string key = fmt::format("{}/boot{}/", name, boots++);
  if (store) {
    const auto* p = static_cast<const std::uint8_t*>(mine);
    store->set(key + std::to_string(rank), Store::Bytes(p, p + bytes));
    // Waited for by the communicator's timeout, not the store's (which may be longer).
    std::vector<std::string> keys;
    for (int r = 0; r < size(); ++r) keys.push_back(key + std::to_string(r));
    store->wait(keys, timeout);
    for (int r = 0; r < size(); ++r) {
      const Store::Bytes v = store->get(key + std::to_string(r));
      MESHFUSE_CHECK(v.size() == bytes, ErrorCode::CommunicationFailure,
                     "communicator {}: rank {} sent {} bytes at set-up, expected {}", name, r,
                     v.size(), bytes);
      std::memcpy(static_cast<std::uint8_t*>(all) + r * bytes, v.data(), bytes);
    }
    return;
  }
  for (const auto& [device, other] : spec.backends)
    if (other != backend) return impl(other).exchange(mine, all, bytes, CommClock::now() + timeout);
  fail(ErrorCode::BackendUnavailable,
       "communicator {}: {} needs a rendezvous store (MASTER_ADDR/MASTER_PORT or "
       "MESHFUSE_STORE_PATH) or another backend in the spec '{}'",
       name, to_string(backend), spec.str());
}

void check_timeout(std::chrono::milliseconds timeout, std::string_view who) {
  // Zero would fail every operation that has to wait at all, at once; past a year, now + timeout
  // overflows the clock (and did, for milliseconds::max()), failing every wait at once too.
  MESHFUSE_CHECK(timeout.count() > 0 && timeout <= kMaxTimeout, ErrorCode::InvalidArgument,
                 "{}: timeout: expected > 0 ms and at most a year ({} ms), got {} ms", who,
                 kMaxTimeout.count(), timeout.count());
}

std::vector<Meta> CommState::exchange_meta(CommImpl& impl, const Meta& mine) {
  const int n = size();
  const std::size_t bytes = Meta::bytes(n);
  std::vector<std::uint8_t> packed(bytes), all(bytes * n);
  Meta stamped = mine;
  stamped.h.exchange = static_cast<std::int32_t>(exchanges++);
  stamped.pack(packed.data());
  impl.exchange(packed.data(), all.data(), bytes, CommClock::now() + timeout);
  std::vector<Meta> metas;
  for (int r = 0; r < n; ++r) metas.push_back(Meta::unpack(all.data() + r * bytes, n));
  compare(metas);
  return metas;
}

void CommState::remember(const CommRecord& record) {
  std::lock_guard lock(history_mutex);
  if (history_size == 0) return;
  history.push_back(record);
  while (history.size() > history_size) history.pop_front();
}

std::shared_ptr<Communicator> CommState::split(int color, int key, const std::vector<int>* group) {
  health->check(name);
  const CommunicatorBackend backend = spec.backends.begin()->second;
  CommImpl& channel = impl(backend);
  const int n = size();
  Meta mine{{kSplitOp, 0, color, -1, group != nullptr, 0, key},
            std::vector<std::int64_t>(n, -1),
            std::vector<std::int64_t>(n, -1)};
  if (group) std::copy(group->begin(), group->end(), mine.in.begin());
  std::vector<Meta> metas;
  try {
    metas = exchange_meta(channel, mine);
  } catch (const Error& e) {
    const std::string what =
        fmt::format("communicator {}: {}: {}", name, group ? "new_group" : "split", e.message());
    if (breaks_communicator(e.code())) health->fail_with(what, &channel);
    throw Error(e.code(), what);
  }
  const int split_index = splits++;
  if (color < 0) return nullptr;
  // Members ordered by (key, rank here).
  std::vector<int> order;
  for (int r = 0; r < n; ++r)
    if (metas[r].h.root == color) order.push_back(r);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return metas[a].h.count < metas[b].h.count; });
  std::vector<int> members;
  for (int r : order) members.push_back(team[r]);
  const int new_rank =
      static_cast<int>(std::find(order.begin(), order.end(), rank) - order.begin());
  return make(
      child(std::move(members), new_rank, fmt::format("{}.s{}c{}", name, split_index, color)));
}

}  // namespace detail

// --- Communicator
// ---------------------------------------------------------------------------------

using detail::CommState;

Communicator::Communicator(std::unique_ptr<CommState> state) : state_(std::move(state)) {}
Communicator::~Communicator() = default;

int Communicator::rank() const { return state_->rank; }
int Communicator::size() const { return state_->size(); }
const std::vector<int>& Communicator::team() const { return state_->team; }
const BackendSpec& Communicator::spec() const { return state_->spec; }
CommunicatorBackend Communicator::backend(DeviceType type) const {
  return state_->spec.for_device(type);
}
std::chrono::milliseconds Communicator::timeout() const { return state_->timeout; }
void Communicator::set_timeout(std::chrono::milliseconds timeout) {
  detail::check_timeout(timeout, "Communicator::set_timeout");
  state_->timeout = timeout;
  for (const auto& [backend, impl] : state_->impls) impl->set_timeout(timeout);
  for_kept_teams([&](Communicator& kept) { kept.set_timeout(timeout); });
}
bool Communicator::checks() const { return state_->check; }
void Communicator::set_checks(bool on) {
  state_->check = on;
  for_kept_teams([&](Communicator& kept) { kept.set_checks(on); });
}

// The teams with_backends and mesh_teams keep serve this communicator's users (executors cache
// them at their first run), so its settings reach them when they change.
void Communicator::for_kept_teams(const std::function<void(Communicator&)>& f) {
  for (const auto& [spec, kept] : state_->respecced) f(*kept);
  for (const auto& [mesh, teams] : state_->mesh_teams)
    for (const auto& team : teams) f(*team);
}

std::vector<CommRecord> Communicator::history() const {
  std::lock_guard lock(state_->history_mutex);
  return {state_->history.begin(), state_->history.end()};
}
std::size_t Communicator::history_size() const { return state_->history_size; }
void Communicator::set_history_size(std::size_t n) {
  std::lock_guard lock(state_->history_mutex);
  state_->history_size = n;
  while (state_->history.size() > n) state_->history.pop_front();
}

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  return state_->split(color, key, nullptr);
}

std::shared_ptr<Communicator> Communicator::new_group(const std::vector<int>& ranks) {
  const int n = size();
  // Refused here on this rank only, it still counts as the split's exchange (which the others
  // make, checks on or off): this rank's next exchange is then out of step with theirs.
  const auto refuse = [&](const std::string& why) {
    ++state_->exchanges;
    throw Error(ErrorCode::InvalidArgument, "new_group: " + why);
  };
  if (ranks.empty() || static_cast<int>(ranks.size()) > n)
    refuse(fmt::format("{} ranks in a team of {}", ranks.size(), n));
  std::vector<bool> seen(n);
  for (int r : ranks) {
    if (r < 0 || r >= n || seen[r])
      refuse(fmt::format("rank {} is outside 0..{} or listed twice", r, n - 1));
    seen[r] = true;
  }
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  const bool member = it != ranks.end();
  return state_->split(member ? 0 : -1, member ? static_cast<int>(it - ranks.begin()) : 0, &ranks);
}

std::shared_ptr<Communicator> Communicator::with_backends(const BackendSpec& spec) {
  state_->health->check(state_->name);
  for (const auto& [device, backend] : spec.backends) {
    MESHFUSE_CHECK(communicator_backend_built(backend), ErrorCode::BackendUnavailable,
                   "communicator {}: with_backends: this build has no {} backend", state_->name,
                   to_string(backend));
    const std::vector<DeviceType> served = communicator_backend_devices(backend);
    MESHFUSE_CHECK(std::find(served.begin(), served.end(), device) != served.end(),
                   ErrorCode::BackendUnavailable,
                   "communicator {}: with_backends: {} cannot serve {} tensors", state_->name,
                   to_string(backend), to_string(device));
    // Said here, not at the backend's set-up inside its first collective, where an executor's
    // run read it as a rank that was elsewhere.
    const bool threads = state_->local != nullptr;
    MESHFUSE_CHECK(
        threads == (backend == CommunicatorBackend::Local), ErrorCode::BackendUnavailable,
        "communicator {}: with_backends: {}; this communicator's ranks are {}", state_->name,
        backend == CommunicatorBackend::Local
            ? "local serves the threads of one LocalWorld (run_local)"
            : fmt::format("{} serves the processes of a launched job", to_string(backend)),
        threads ? "threads of a LocalWorld, which only local serves"
                : "processes of " + state_->launch.str());
  }
  std::shared_ptr<Communicator>& kept = state_->respecced[spec.str()];
  if (!kept) {
    auto c = state_->child(state_->team, state_->rank,
                           fmt::format("{}.b{}", state_->name, state_->respecs++));
    c->spec = spec;
    kept = CommState::make(std::move(c));
  }
  return kept;
}

std::vector<std::shared_ptr<Communicator>> Communicator::mesh_teams(const DeviceMesh& mesh) {
  std::vector<int> in_order(static_cast<std::size_t>(size()));
  std::iota(in_order.begin(), in_order.end(), 0);
  // Not kept: the communicator would hold itself.
  if (mesh.ndim() == 1 && mesh.ranks() == in_order) return {shared_from_this()};
  std::vector<int> sorted = mesh.ranks();
  std::sort(sorted.begin(), sorted.end());
  MESHFUSE_CHECK(sorted == in_order, ErrorCode::InvalidArgument,
                 "communicator {}: mesh_teams: {} must be laid over the team's ranks 0 .. {}, "
                 "each once",
                 state_->name, mesh.to_string(), size() - 1);
  const std::string key = mesh.to_string();
  if (auto it = state_->mesh_teams.find(key); it != state_->mesh_teams.end()) return it->second;
  const std::vector<std::int64_t> at = mesh.coordinates(rank());
  std::vector<std::shared_ptr<Communicator>> teams;
  for (std::int64_t m = 0; m < mesh.ndim(); ++m) {
    // The ranks that share every coordinate but m: one color per line along m.
    std::int64_t color = 0;
    for (std::int64_t d = 0; d < mesh.ndim(); ++d)
      if (d != m) color = color * mesh.size(d) + at[static_cast<std::size_t>(d)];
    teams.push_back(
        split(static_cast<int>(color), static_cast<int>(at[static_cast<std::size_t>(m)])));
  }
  return state_->mesh_teams.emplace(key, std::move(teams)).first->second;
}

}  // namespace meshfuse
