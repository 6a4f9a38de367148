// The generic layer of every communicator: argument checks, the backend of each device type, the
// cross-rank metadata check, records and the errors that carry them. Backends only move bytes
// (comm_impl.h).
#include "meshfuse/distributed/communicator.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>

#include "distributed/comm_impl.h"
#include "distributed/local.h"
#include "distributed/reduce.h"
#include "meshfuse/core/error.h"

namespace meshfuse {

// --- names
// ----------------------------------------------------------------------------------------

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

constexpr CommunicatorBackend kBackends[] = {CommunicatorBackend::Local, CommunicatorBackend::Gloo,
                                             CommunicatorBackend::Mpi, CommunicatorBackend::Nccl};
constexpr ReduceOp kReduceOps[] = {ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max,
                                   ReduceOp::Avg};
constexpr CommOp kCommOps[] = {CommOp::AllGather, CommOp::ReduceScatter, CommOp::AllReduce,
                               CommOp::Broadcast, CommOp::Reduce,        CommOp::Gather,
                               CommOp::Scatter,   CommOp::AllToAll,      CommOp::Send,
                               CommOp::Recv,      CommOp::Barrier};

template <typename E, std::size_t N>
std::string names_of(const E (&values)[N]) {
  std::string s;
  for (E v : values) {
    if (!s.empty()) s += ", ";
    s += to_string(v);
  }
  return s;
}

}  // namespace

std::string_view to_string(CommunicatorBackend backend) {
  switch (backend) {
    case CommunicatorBackend::Local:
      return "local";
    case CommunicatorBackend::Gloo:
      return "gloo";
    case CommunicatorBackend::Mpi:
      return "mpi";
    case CommunicatorBackend::Nccl:
      return "nccl";
  }
  return "?";
}

CommunicatorBackend parse_communicator_backend(std::string_view name) {
  const std::string n = lower(name);
  for (CommunicatorBackend b : kBackends)
    if (n == to_string(b)) return b;
  fail(ErrorCode::InvalidArgument, "communicator backend: unknown name '{}' (expected one of {})",
       name, names_of(kBackends));
}

bool communicator_backend_built(CommunicatorBackend backend) {
  switch (backend) {
    case CommunicatorBackend::Local:
      return true;
#ifdef MESHFUSE_WITH_GLOO
    case CommunicatorBackend::Gloo:
      return true;
#endif
#ifdef MESHFUSE_WITH_MPI
    case CommunicatorBackend::Mpi:
      return true;
#endif
#ifdef MESHFUSE_WITH_NCCL
    case CommunicatorBackend::Nccl:
      return true;
#endif
    default:
      return false;
  }
}

std::vector<DeviceType> communicator_backend_devices(CommunicatorBackend backend) {
  if (backend == CommunicatorBackend::Nccl) return {DeviceType::CUDA};
  return {DeviceType::CPU};
}

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Prod:
      return "prod";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Avg:
      return "avg";
  }
  return "?";
}

ReduceOp parse_reduce_op(std::string_view name) {
  const std::string n = lower(name);
  if (n == "product") return ReduceOp::Prod;
  if (n == "mean") return ReduceOp::Avg;
  for (ReduceOp op : kReduceOps)
    if (n == to_string(op)) return op;
  fail(ErrorCode::InvalidArgument, "reduce op: unknown name '{}' (expected one of {})", name,
       names_of(kReduceOps));
}

std::string_view to_string(CommOp op) {
  switch (op) {
    case CommOp::AllGather:
      return "all_gather";
    case CommOp::ReduceScatter:
      return "reduce_scatter";
    case CommOp::AllReduce:
      return "all_reduce";
    case CommOp::Broadcast:
      return "broadcast";
    case CommOp::Reduce:
      return "reduce";
    case CommOp::Gather:
      return "gather";
    case CommOp::Scatter:
      return "scatter";
    case CommOp::AllToAll:
      return "all_to_all";
    case CommOp::Send:
      return "send";
    case CommOp::Recv:
      return "recv";
    case CommOp::Barrier:
      return "barrier";
  }
  return "?";
}

CommOp parse_comm_op(std::string_view name) {
  const std::string n = lower(name);
  for (CommOp op : kCommOps)
    if (n == to_string(op)) return op;
  fail(ErrorCode::InvalidArgument, "communication op: unknown name '{}' (expected one of {})", name,
       names_of(kCommOps));
}

// --- BackendSpec
// ----------------------------------------------------------------------------------

BackendSpec BackendSpec::defaults() {
  return BackendSpec{{{DeviceType::CPU, CommunicatorBackend::Gloo},
                      {DeviceType::CUDA, CommunicatorBackend::Nccl}}};
}

BackendSpec BackendSpec::parse(std::string_view text) {
  if (text.empty()) return defaults();
  BackendSpec spec;
  if (text.find(':') == std::string_view::npos) {
    const CommunicatorBackend b = parse_communicator_backend(text);
    for (DeviceType d : communicator_backend_devices(b)) spec.backends[d] = b;
    return spec;
  }
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    std::string_view item = text.substr(start, end - start);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front())))
      item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back())))
      item.remove_suffix(1);
    const std::size_t colon = item.find(':');
    MESHFUSE_CHECK(colon != std::string_view::npos, ErrorCode::InvalidArgument,
                   "backend spec '{}': '{}' is not device:backend", text, item);
    const DeviceType device = Device::parse(item.substr(0, colon)).type;
    const CommunicatorBackend backend = parse_communicator_backend(item.substr(colon + 1));
    const std::vector<DeviceType> served = communicator_backend_devices(backend);
    MESHFUSE_CHECK(std::find(served.begin(), served.end(), device) != served.end(),
                   ErrorCode::InvalidArgument, "backend spec '{}': {} cannot serve {} tensors",
                   text, to_string(backend), to_string(device));
    MESHFUSE_CHECK(spec.backends.emplace(device, backend).second, ErrorCode::InvalidArgument,
                   "backend spec '{}': {} is listed twice", text, to_string(device));
    start = end + 1;
  }
  return spec;
}

CommunicatorBackend BackendSpec::for_device(DeviceType type) const {
  auto it = backends.find(type);
  MESHFUSE_CHECK(it != backends.end(), ErrorCode::BackendUnavailable,
                 "communicator: the backend spec '{}' has no backend for {} tensors", str(),
                 to_string(type));
  return it->second;
}

std::string BackendSpec::str() const {
  std::string s;
  for (const auto& [device, backend] : backends)
    s += fmt::format("{}{}:{}", s.empty() ? "" : ",", to_string(device), to_string(backend));
  return s;
}

// --- CommRecord
// -----------------------------------------------------------------------------------

namespace {

std::string bytes_str(std::int64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes) / 1024;
  int u = 0;
  while (v >= 1024 && u < 3) {
    v /= 1024;
    ++u;
  }
  return fmt::format("{:.4g} {}", v, kUnits[u]);
}

std::string ranks_str(const std::vector<int>& ranks) {
  std::string s = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? " " : "") + std::to_string(ranks[i]);
  return s + "]";
}

bool is_rooted(CommOp op) {
  return op == CommOp::Broadcast || op == CommOp::Reduce || op == CommOp::Gather ||
         op == CommOp::Scatter;
}

}  // namespace

std::string CommRecord::to_string() const {
  std::string s(meshfuse::to_string(op));
  if (reduction) s += fmt::format("({})", meshfuse::to_string(*reduction));
  if (op != CommOp::Barrier)
    s += fmt::format(" {} x {}{} ({})", meshfuse::to_string(dtype), count, uneven ? " uneven" : "",
                     bytes_str(bytes));
  s += fmt::format(" on {}, team {}, rank {}", meshfuse::to_string(backend), ranks_str(team), rank);
  if (is_rooted(op)) s += fmt::format(", root {}", root);
  if (op == CommOp::Send) s += fmt::format(", to {}", root);
  if (op == CommOp::Recv) s += fmt::format(", from {}", root);
  return s + fmt::format(", #{}", seq);
}

// --- Work
// -----------------------------------------------------------------------------------------

namespace detail {

namespace {

// The message of an Error without the "[code] " prefix that what() adds.
std::string message_of(const Error& e) {
  const std::string what = e.what();
  const std::string prefix = fmt::format("[{}] ", to_string(e.code()));
  return what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what;
}

bool breaks_communicator(ErrorCode code) {
  return code == ErrorCode::Timeout || code == ErrorCode::CommunicationFailure;
}

}  // namespace

// Whether a communicator is still in step with its peers.
struct Health {
  std::mutex mutex;
  std::string broken;  // why it is not; empty while it is

  void check(const std::string& name) {
    std::lock_guard lock(mutex);
    MESHFUSE_CHECK(broken.empty(), ErrorCode::CommunicationFailure,
                   "communicator {} is unusable after an earlier failure: {}", name, broken);
  }
  // Records the first failure and aborts the backend once.
  void fail_with(const std::string& why, CommImpl* impl) {
    {
      std::lock_guard lock(mutex);
      if (!broken.empty()) return;
      broken = why;
    }
    if (impl) impl->abort();
  }
};

// Wraps an error of an operation with its record; a timeout or transport failure breaks the
// communicator.
[[noreturn]] void rethrow_for(const CommRecord& record, const Error& e,
                              std::chrono::milliseconds timeout, Health& health, CommImpl* impl) {
  std::string message = record.to_string() + ": ";
  if (e.code() == ErrorCode::Timeout)
    message += fmt::format(
        "not finished after {} ms (has every rank of the team called it? is one dead?): ",
        timeout.count());
  message += message_of(e);
  if (breaks_communicator(e.code())) health.fail_with(message, impl);
  throw Error(e.code(), message);
}

struct WorkState {
  CommRecord record;
  std::shared_ptr<WorkImpl> impl;
  std::shared_ptr<CommImpl> comm;  // kept alive while the work may run
  std::shared_ptr<Health> health;
  std::chrono::milliseconds timeout{};

  std::mutex mutex;
  bool finished = false;
  std::exception_ptr error;

  void wait(std::chrono::milliseconds wait_timeout) {
    {
      std::lock_guard lock(mutex);
      if (finished) {
        if (error) std::rethrow_exception(error);
        return;
      }
    }
    std::exception_ptr failure;
    try {
      impl->wait(CommClock::now() + wait_timeout);
    } catch (const Error& e) {
      try {
        rethrow_for(record, e, wait_timeout, *health, comm.get());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    std::lock_guard lock(mutex);
    if (!finished) {
      finished = true;
      error = failure;
    }
    if (error) std::rethrow_exception(error);
  }
};

}  // namespace detail

Work::Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

void Work::wait() {
  if (state_) state_->wait(state_->timeout);
}

void Work::wait(std::chrono::milliseconds timeout) {
  if (state_) state_->wait(timeout);
}

bool Work::is_completed() const {
  if (!state_) return true;
  {
    std::lock_guard lock(state_->mutex);
    if (state_->finished) return true;
  }
  return state_->impl->test();
}

const CommRecord& Work::record() const {
  static const CommRecord kEmpty;
  return state_ ? state_->record : kEmpty;
}

// --- the metadata check
// ---------------------------------------------------------------------------

namespace detail {

namespace {

// Pseudo-operations that go through the same exchange as collectives.
constexpr int kSplitOp = 100;

// What each rank says about an operation: a fixed header and two lists of team-size entries
// (elements per rank, or for new_group the rank list), so every rank exchanges the same size.
struct MetaHeader {
  std::int32_t op;
  std::int32_t dtype;
  std::int32_t root;
  std::int32_t reduction;  // -1: none
  std::int32_t uneven;
  std::int32_t pad = 0;
  std::int64_t count;  // see CommRecord::count; split: key
};

struct Meta {
  MetaHeader h;
  std::vector<std::int64_t> in, out;  // size() entries each

  static std::size_t bytes(int n) { return sizeof(MetaHeader) + 2 * n * sizeof(std::int64_t); }
  void pack(std::uint8_t* p) const {
    std::memcpy(p, &h, sizeof(h));
    std::memcpy(p + sizeof(h), in.data(), in.size() * 8);
    std::memcpy(p + sizeof(h) + in.size() * 8, out.data(), out.size() * 8);
  }
  static Meta unpack(const std::uint8_t* p, int n) {
    Meta m;
    std::memcpy(&m.h, p, sizeof(m.h));
    m.in.resize(n);
    m.out.resize(n);
    std::memcpy(m.in.data(), p + sizeof(m.h), n * 8);
    std::memcpy(m.out.data(), p + sizeof(m.h) + n * 8, n * 8);
    return m;
  }
};

std::string list_str(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s + "]";
}

// The part of a rank's metadata every rank must agree on, as text for the error.
std::string signature(const Meta& m) {
  if (m.h.op == kSplitOp) return m.h.uneven ? "new_group " + list_str(m.in) : std::string("split");
  const auto op = static_cast<CommOp>(m.h.op);
  std::string s(to_string(op));
  if (m.h.reduction >= 0) s += fmt::format("({})", to_string(static_cast<ReduceOp>(m.h.reduction)));
  if (op == CommOp::Barrier) return s;
  s += fmt::format(" {}", to_string(static_cast<DType>(m.h.dtype)));
  const bool shared_splits = m.h.uneven && (op == CommOp::AllGather || op == CommOp::ReduceScatter);
  if (shared_splits)
    s += " split " + list_str(op == CommOp::AllGather ? m.out : m.in) + " elements";
  else if (op != CommOp::AllToAll)
    s += fmt::format(" x {}", m.h.count);
  if (is_rooted(op)) s += fmt::format(", root {}", m.h.root);
  return s;
}

// Every rank runs this on the same metadata, so every rank throws the same error.
void compare(const std::vector<Meta>& metas) {
  const int n = static_cast<int>(metas.size());
  const std::string first = signature(metas[0]);
  std::string others;
  for (int r = 1; r < n; ++r)
    if (const std::string s = signature(metas[r]); s != first)
      others += fmt::format("{}rank {} has {}", others.empty() ? "" : ", ", r, s);
  MESHFUSE_CHECK(others.empty(), ErrorCode::InvalidArgument, "ranks disagree: rank 0 has {} but {}",
                 first, others);
  if (metas[0].h.op == kSplitOp) return;
  const auto op = static_cast<CommOp>(metas[0].h.op);
  if (op == CommOp::AllToAll) {
    for (int r = 0; r < n; ++r)
      for (int s = 0; s < n; ++s)
        MESHFUSE_CHECK(metas[r].in[s] == metas[s].out[r], ErrorCode::InvalidArgument,
                       "ranks disagree: rank {} sends {} elements to rank {}, which expects {}", r,
                       metas[r].in[s], s, metas[s].out[r]);
  }
}

}  // namespace

// --- CommState
// ------------------------------------------------------------------------------------

struct CommState {
  std::vector<int> team;
  int rank = 0;
  BackendSpec spec;
  LaunchInfo launch;
  std::shared_ptr<Store> store;  // the job's store, shared by all teams; may be null
  std::shared_ptr<LocalWorldState> local;
  std::string name;
  std::chrono::milliseconds timeout{};
  bool check = true;

  mutable std::mutex history_mutex;
  std::deque<CommRecord> history;
  std::size_t history_size = 0;

  std::map<CommunicatorBackend, std::shared_ptr<CommImpl>> impls;
  std::uint64_t seq = 0;
  int splits = 0;
  int boots = 0;
  std::shared_ptr<Health> health = std::make_shared<Health>();

  int size() const { return static_cast<int>(team.size()); }

  static std::shared_ptr<Communicator> make(std::unique_ptr<CommState> state) {
    return std::shared_ptr<Communicator>(new Communicator(std::move(state)));
  }

  // A child team that shares everything but its members and name.
  std::unique_ptr<CommState> child(std::vector<int> members, int new_rank,
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

  // The backend's view of this team, set up on first use (collectively: every rank of the team
  // reaches it at the same operation).
  CommImpl& impl(CommunicatorBackend backend) {
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
    return *impls.emplace(backend, std::move(created)).first->second;
  }

  // Before `backend` exists: through the store, else through another backend of the spec.
  void bootstrap_exchange(CommunicatorBackend backend, const void* mine, void* all,
                          std::size_t bytes) {
    const std::string key = fmt::format("{}/boot{}/", name, boots++);
    if (store) {
      const auto* p = static_cast<const std::uint8_t*>(mine);
      store->set(key + std::to_string(rank), Store::Bytes(p, p + bytes));
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
      if (other != backend)
        return impl(other).exchange(mine, all, bytes, CommClock::now() + timeout);
    fail(ErrorCode::BackendUnavailable,
         "communicator {}: {} needs a rendezvous store (MASTER_ADDR/MASTER_PORT or "
         "MESHFUSE_STORE_PATH) or another backend in the spec '{}'",
         name, to_string(backend), spec.str());
  }

  // All ranks' metadata through the backend; throws the mismatch on every rank.
  std::vector<Meta> exchange_meta(CommImpl& impl, const Meta& mine) {
    const int n = size();
    const std::size_t bytes = Meta::bytes(n);
    std::vector<std::uint8_t> packed(bytes), all(bytes * n);
    mine.pack(packed.data());
    impl.exchange(packed.data(), all.data(), bytes, CommClock::now() + timeout);
    std::vector<Meta> metas;
    for (int r = 0; r < n; ++r) metas.push_back(Meta::unpack(all.data() + r * bytes, n));
    compare(metas);
    return metas;
  }

  void remember(const CommRecord& record) {
    std::lock_guard lock(history_mutex);
    if (history_size == 0) return;
    history.push_back(record);
    while (history.size() > history_size) history.pop_front();
  }

  std::shared_ptr<Communicator> split(int color, int key, const std::vector<int>* group) {
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
      const std::string what = fmt::format("communicator {}: {}: {}", name,
                                           group ? "new_group" : "split", message_of(e));
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
};

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
void Communicator::set_timeout(std::chrono::milliseconds timeout) { state_->timeout = timeout; }
bool Communicator::checks() const { return state_->check; }
void Communicator::set_checks(bool on) { state_->check = on; }

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
  MESHFUSE_CHECK(!ranks.empty() && static_cast<int>(ranks.size()) <= n, ErrorCode::InvalidArgument,
                 "new_group: {} ranks in a team of {}", ranks.size(), n);
  std::vector<bool> seen(n);
  for (int r : ranks) {
    MESHFUSE_CHECK(r >= 0 && r < n && !seen[r], ErrorCode::InvalidArgument,
                   "new_group: rank {} is outside 0..{} or listed twice", r, n - 1);
    seen[r] = true;
  }
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  const bool member = it != ranks.end();
  return state_->split(member ? 0 : -1, member ? static_cast<int>(it - ranks.begin()) : 0, &ranks);
}

// --- the operations
// -------------------------------------------------------------------------------

namespace {

// One call, as the generic layer sees it.
struct Call {
  Call(CommOp op, std::vector<TensorView> tensors) : op(op), tensors(std::move(tensors)) {}

  CommOp op;
  std::vector<TensorView> tensors;  // the defined ones
  int root = -1;
  std::optional<ReduceOp> reduction;
  std::int64_t count = 0;  // see CommRecord::count
  std::int64_t bytes = 0;
  bool uneven = false;
  std::vector<std::int64_t> in_counts, out_counts;  // elements per rank, where they apply
  Stream stream;
  DType dtype = DType::U8;
  Device device{};
};

std::string op_name(CommOp op) { return std::string(to_string(op)); }

// Checks the tensors (contiguous, one dtype, one device) and the stream; fills dtype and device.
void check_tensors(Call& c, const Stream& stream) {
  const std::string op = op_name(c.op);
  if (c.tensors.empty()) {
    c.stream = stream;
    c.device = stream.device;
    return;
  }
  const TensorView& first = c.tensors.front();
  c.dtype = first.dtype();
  c.device = first.device();
  for (const TensorView& t : c.tensors) {
    MESHFUSE_CHECK(t.is_contiguous(), ErrorCode::InvalidArgument,
                   "{}: tensors must be contiguous, got {}", op, t.str());
    MESHFUSE_CHECK(t.dtype() == c.dtype, ErrorCode::DTypeMismatch,
                   "{}: tensors must share one dtype, got {} and {}", op, first.str(), t.str());
    MESHFUSE_CHECK(t.device() == c.device, ErrorCode::DeviceMismatch,
                   "{}: tensors must be on one device, got {} and {}", op, first.str(), t.str());
  }
  c.stream = stream;
  // CUDA tensors with the default (CPU) stream run on their device's legacy default stream.
  if (c.device.type != DeviceType::CPU && stream.device.type == DeviceType::CPU)
    c.stream = Stream{c.device, nullptr};
  MESHFUSE_CHECK(c.stream.device == c.device, ErrorCode::DeviceMismatch,
                 "{}: the stream is on {} but the tensors on {}", op, c.stream.device.str(),
                 c.device.str());
}

void check_rank(int r, int size, const char* what, CommOp op) {
  MESHFUSE_CHECK(r >= 0 && r < size, ErrorCode::InvalidArgument,
                 "{}: {} {} is outside the team's ranks 0..{}", op_name(op), what, r, size - 1);
}

// A contiguous tensor as a flat 1-D view (what backends receive).
TensorView flat(const TensorView& t) {
  if (!t.defined()) return t;
  return TensorView(t.data(), t.dtype(), Shape{t.numel()}, t.device());
}

std::int64_t row_elements(const TensorView& t) {
  Shape trailing(t.shape().begin() + 1, t.shape().end());
  return shape_numel(trailing);
}

// Split sizes (rows of dim 0) -> elements per rank; checks the count and the sum.
std::vector<std::int64_t> split_elements(const std::vector<std::int64_t>& rows, const TensorView& t,
                                         int size, const char* which, CommOp op) {
  const std::string name = op_name(op);
  MESHFUSE_CHECK(t.dim() >= 1, ErrorCode::InvalidArgument,
                 "{}: split sizes need tensors of at least one dim, got {}", name, t.str());
  std::vector<std::int64_t> rows_used = rows;
  if (rows_used.empty()) {  // equal rows
    MESHFUSE_CHECK(t.size(0) % size == 0, ErrorCode::InvalidArgument,
                   "{}: without {}, dim 0 of {} must divide by the team size {}", name, which,
                   t.str(), size);
    rows_used.assign(size, t.size(0) / size);
  }
  MESHFUSE_CHECK(static_cast<int>(rows_used.size()) == size, ErrorCode::InvalidArgument,
                 "{}: {} has {} entries for a team of {}", name, which, rows_used.size(), size);
  std::int64_t sum = 0;
  for (std::int64_t r : rows_used) {
    MESHFUSE_CHECK(r >= 0, ErrorCode::InvalidArgument, "{}: {} {} has a negative size", name, which,
                   detail::list_str(rows_used));
    sum += r;
  }
  MESHFUSE_CHECK(sum == t.size(0), ErrorCode::InvalidArgument,
                 "{}: {} {} add up to {} rows but the tensor {} has {}", name, which,
                 detail::list_str(rows_used), sum, t.str(), t.size(0));
  const std::int64_t row = row_elements(t);
  for (std::int64_t& r : rows_used) r *= row;
  return rows_used;
}

void check_same_rows(const TensorView& a, const TensorView& b, CommOp op) {
  MESHFUSE_CHECK(a.dim() >= 1 && a.dim() == b.dim() &&
                     std::equal(a.shape().begin() + 1, a.shape().end(), b.shape().begin() + 1),
                 ErrorCode::ShapeMismatch, "{}: {} and {} must agree in every dim but dim 0",
                 op_name(op), a.str(), b.str());
}

void check_numel(const TensorView& t, std::int64_t expected, const char* what, CommOp op) {
  MESHFUSE_CHECK(t.numel() == expected, ErrorCode::ShapeMismatch,
                 "{}: {} {} should have {} elements", op_name(op), what, t.str(), expected);
}

template <typename F>
Work start(CommState& s, Call& c, F&& run) {
  s.health->check(s.name);
  const CommunicatorBackend backend = s.spec.for_device(c.device.type);
  MESHFUSE_CHECK(!c.reduction || c.dtype != DType::Bool, ErrorCode::InvalidArgument,
                 "{}: cannot reduce bool tensors (use u8)", op_name(c.op));
  if (c.reduction) detail::check_reducible(c.dtype, *c.reduction, op_name(c.op));
  detail::CommImpl& impl = s.impl(backend);

  CommRecord record;
  record.op = c.op;
  record.backend = backend;
  record.team = s.team;
  record.rank = s.rank;
  record.root = c.root;
  record.reduction = c.reduction;
  record.dtype = c.dtype;
  record.count = c.count;
  record.bytes = c.bytes;
  record.seq = s.seq++;
  record.uneven = c.uneven;
  s.remember(record);

  try {
    if (s.check && c.op != CommOp::Send && c.op != CommOp::Recv) {
      const int n = s.size();
      detail::Meta meta{
          {static_cast<std::int32_t>(c.op), static_cast<std::int32_t>(c.dtype), c.root,
           c.reduction ? static_cast<std::int32_t>(*c.reduction) : -1, c.uneven, 0, c.count},
          c.in_counts,
          c.out_counts};
      meta.in.resize(n, 0);
      meta.out.resize(n, 0);
      s.exchange_meta(impl, meta);
    }
    auto work = std::make_shared<detail::WorkState>();
    work->impl = run(impl);
    work->record = std::move(record);
    work->comm = s.impls.at(backend);
    work->health = s.health;
    work->timeout = s.timeout;
    return Work(std::move(work));
  } catch (const Error& e) {
    detail::rethrow_for(record, e, s.timeout, *s.health, &impl);
  }
}

std::int64_t bytes_of(std::int64_t elements, DType dtype) {
  return elements * static_cast<std::int64_t>(element_size(dtype));
}

}  // namespace

Work Communicator::all_reduce(const TensorView& tensor, ReduceOp op, const Stream& stream) {
  Call c(CommOp::AllReduce, {tensor});
  c.reduction = op;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c,
               [&](detail::CommImpl& impl) { return impl.all_reduce(flat(tensor), op, c.stream); });
}

Work Communicator::broadcast(const TensorView& tensor, int root, const Stream& stream) {
  Call c(CommOp::Broadcast, {tensor});
  check_rank(root, size(), "root", c.op);
  c.root = root;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.broadcast(flat(tensor), root, c.stream);
  });
}

Work Communicator::reduce(const TensorView& tensor, int root, ReduceOp op, const Stream& stream) {
  Call c(CommOp::Reduce, {tensor});
  check_rank(root, size(), "root", c.op);
  c.root = root;
  c.reduction = op;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.reduce(flat(tensor), root, op, c.stream);
  });
}

Work Communicator::all_gather(const TensorView& input, const TensorView& output,
                              const Stream& stream) {
  Call c(CommOp::AllGather, {input, output});
  check_tensors(c, stream);
  check_numel(output, size() * input.numel(), "output", c.op);
  c.count = input.numel();
  c.bytes = bytes_of(output.numel(), c.dtype);
  c.out_counts.assign(size(), input.numel());
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.all_gather(flat(input), flat(output), c.out_counts, c.stream);
  });
}

Work Communicator::all_gather(const TensorView& input, const TensorView& output,
                              const std::vector<std::int64_t>& output_split_sizes,
                              const Stream& stream) {
  Call c(CommOp::AllGather, {input, output});
  check_tensors(c, stream);
  check_same_rows(input, output, c.op);
  c.uneven = true;
  c.out_counts = split_elements(output_split_sizes, output, size(), "output_split_sizes", c.op);
  check_numel(input, c.out_counts[rank()], "input", c.op);
  c.count = input.numel();
  c.bytes = bytes_of(output.numel(), c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.all_gather(flat(input), flat(output), c.out_counts, c.stream);
  });
}

Work Communicator::reduce_scatter(const TensorView& input, const TensorView& output, ReduceOp op,
                                  const Stream& stream) {
  Call c(CommOp::ReduceScatter, {input, output});
  c.reduction = op;
  check_tensors(c, stream);
  check_numel(input, size() * output.numel(), "input", c.op);
  c.count = output.numel();
  c.bytes = bytes_of(input.numel(), c.dtype);
  c.in_counts.assign(size(), output.numel());
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.reduce_scatter(flat(input), flat(output), c.in_counts, op, c.stream);
  });
}

Work Communicator::reduce_scatter(const TensorView& input, const TensorView& output,
                                  const std::vector<std::int64_t>& input_split_sizes, ReduceOp op,
                                  const Stream& stream) {
  Call c(CommOp::ReduceScatter, {input, output});
  c.reduction = op;
  check_tensors(c, stream);
  check_same_rows(input, output, c.op);
  c.uneven = true;
  c.in_counts = split_elements(input_split_sizes, input, size(), "input_split_sizes", c.op);
  check_numel(output, c.in_counts[rank()], "output", c.op);
  c.count = output.numel();
  c.bytes = bytes_of(input.numel(), c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.reduce_scatter(flat(input), flat(output), c.in_counts, op, c.stream);
  });
}

Work Communicator::gather(const TensorView& input, const TensorView& output, int root,
                          const Stream& stream) {
  check_rank(root, size(), "root", CommOp::Gather);
  const bool is_root = rank() == root;
  Call c(CommOp::Gather, {input});
  if (is_root) c.tensors.push_back(output);
  c.root = root;
  check_tensors(c, stream);
  if (is_root) check_numel(output, size() * input.numel(), "output", c.op);
  c.count = input.numel();
  c.bytes = bytes_of(is_root ? output.numel() : c.count, c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.gather(flat(input), is_root ? flat(output) : TensorView{}, root, c.stream);
  });
}

Work Communicator::scatter(const TensorView& input, const TensorView& output, int root,
                           const Stream& stream) {
  check_rank(root, size(), "root", CommOp::Scatter);
  const bool is_root = rank() == root;
  Call c(CommOp::Scatter, {output});
  if (is_root) c.tensors.push_back(input);
  c.root = root;
  check_tensors(c, stream);
  if (is_root) check_numel(input, size() * output.numel(), "input", c.op);
  c.count = output.numel();
  c.bytes = bytes_of(is_root ? input.numel() : c.count, c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.scatter(is_root ? flat(input) : TensorView{}, flat(output), root, c.stream);
  });
}

Work Communicator::all_to_all(const TensorView& input, const TensorView& output,
                              const std::vector<std::int64_t>& input_split_sizes,
                              const std::vector<std::int64_t>& output_split_sizes,
                              const Stream& stream) {
  Call c(CommOp::AllToAll, {input, output});
  check_tensors(c, stream);
  const int n = size();
  if (input_split_sizes.empty() && output_split_sizes.empty()) {
    MESHFUSE_CHECK(input.numel() % n == 0, ErrorCode::InvalidArgument,
                   "all_to_all: without split sizes the input {} must divide into {} blocks",
                   input.str(), n);
    check_numel(output, input.numel(), "output", c.op);
    c.in_counts.assign(n, input.numel() / n);
    c.out_counts = c.in_counts;
  } else {
    check_same_rows(input, output, c.op);
    c.uneven = true;
    c.in_counts = split_elements(input_split_sizes, input, n, "input_split_sizes", c.op);
    c.out_counts = split_elements(output_split_sizes, output, n, "output_split_sizes", c.op);
  }
  c.count = input.numel();
  c.bytes = bytes_of(std::max(input.numel(), output.numel()), c.dtype);
  return start(*state_, c, [&](detail::CommImpl& impl) {
    return impl.all_to_all(flat(input), flat(output), c.in_counts, c.out_counts, c.stream);
  });
}

Work Communicator::send(const TensorView& tensor, int dst, int tag, const Stream& stream) {
  Call c(CommOp::Send, {tensor});
  check_rank(dst, size(), "destination", c.op);
  MESHFUSE_CHECK(dst != rank() && tag >= 0, ErrorCode::InvalidArgument,
                 "send: to rank {} with tag {} from rank {} (no sends to self, tags >= 0)", dst,
                 tag, rank());
  c.root = dst;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c,
               [&](detail::CommImpl& impl) { return impl.send(flat(tensor), dst, tag, c.stream); });
}

Work Communicator::recv(const TensorView& tensor, int src, int tag, const Stream& stream) {
  Call c(CommOp::Recv, {tensor});
  check_rank(src, size(), "source", c.op);
  MESHFUSE_CHECK(src != rank() && tag >= 0, ErrorCode::InvalidArgument,
                 "recv: from rank {} with tag {} on rank {} (no receives from self, tags >= 0)",
                 src, tag, rank());
  c.root = src;
  check_tensors(c, stream);
  c.count = tensor.numel();
  c.bytes = bytes_of(c.count, c.dtype);
  return start(*state_, c,
               [&](detail::CommImpl& impl) { return impl.recv(flat(tensor), src, tag, c.stream); });
}

Work Communicator::barrier(const Stream& stream) {
  Call c(CommOp::Barrier, {});
  check_tensors(c, stream);
  return start(*state_, c, [&](detail::CommImpl& impl) { return impl.barrier(c.stream); });
}

// --- creating communicators
// -----------------------------------------------------------------------

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
  CommOptions options = given;
  if (const char* env = std::getenv("MESHFUSE_BACKEND"); options.backend.empty() && env)
    options.backend = env;
  const LaunchInfo launch = launch_info_from_env();
  std::shared_ptr<Store> store = store_from_env(launch, options.timeout);
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
  const BackendSpec spec = BackendSpec::parse(options.backend.empty() ? "local" : options.backend);
  MESHFUSE_CHECK(
      spec.backends.size() == 1 && spec.backends.begin()->second == CommunicatorBackend::Local,
      ErrorCode::InvalidArgument, "LocalWorld: backend '{}' is not local", options.backend);
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
  auto state = world_state(launch, BackendSpec::parse("local"), options_);
  state->store = state_->store;
  state->local = state_;
  return CommState::make(std::move(state));
}

void run_local(int size, const std::function<void(Communicator&)>& fn, const CommOptions& options) {
  LocalWorld world(size, options);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(world.communicator(r));
  std::vector<std::exception_ptr> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(*comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace meshfuse
