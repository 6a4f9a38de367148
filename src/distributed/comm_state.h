// The generic layer's shared state (internal): what stands behind a Communicator (CommState) and
// a Work (WorkState), and the metadata the ranks compare before an operation. Defined in
// communicator.cpp (CommState), work.cpp (Work), metadata_check.cpp and comm_record.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "distributed/comm_impl.h"
#include "meshfuse/core/error.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse::detail {

// Whether the operation has a root (broadcast, reduce, gather, scatter).
bool is_rooted(CommOp op);

// --- Work (work.cpp)

// Whether an error leaves the communicator out of step with its peers.
bool breaks_communicator(ErrorCode code);

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
                              std::chrono::milliseconds timeout, Health& health, CommImpl* impl);

struct WorkState {
  WorkState() = default;
  WorkState(const WorkState&) = delete;
  WorkState& operator=(const WorkState&) = delete;
  // Hands the operation (`impl`, `kept`) to a process-wide list while its transfer is in flight
  // and it keeps buffers.
  ~WorkState();

  CommRecord record;
  std::shared_ptr<WorkImpl> impl;
  std::shared_ptr<CommImpl> comm;  // kept alive while the work may run
  std::shared_ptr<Health> health;
  std::chrono::milliseconds timeout{};

  std::mutex mutex;
  bool finished = false;
  std::exception_ptr error;
  std::vector<Tensor> kept;  // Work::keep_alive

  void wait(std::chrono::milliseconds wait_timeout);
};

// Frees the buffers kept by works dropped in flight whose transfers have ended since; cheap when
// there are none. Called as each operation starts.
void free_finished_buffers() noexcept;

// Throws InvalidArgument, naming `who`, unless a communicator's timeout is positive.
void check_timeout(std::chrono::milliseconds timeout, std::string_view who);

// --- the metadata check (metadata_check.cpp)

// Pseudo-operations that go through the same exchange as collectives.
constexpr int kSplitOp = 100;

// What each rank says about an operation: a fixed header and two lists of team-size entries
// (elements per rank, or for new_group the rank list), so every rank exchanges the same size.
struct MetaHeader {
  std::int32_t op;
  std::int32_t dtype;
  std::int32_t root;
  std::int32_t reduction;  // -1: none
  std::int32_t split_sizes;   // called with split sizes; for kSplitOp: new_group (ranks in `in`)
  std::int32_t exchange = 0;  // CommState::exchanges when it was made (modulo 2^32), stamped there
  std::int64_t count;         // see CommRecord::count; split: key
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

// A list as "[1 2 3]", for messages.
std::string list_str(const std::vector<std::int64_t>& v);

// Every rank runs this on the same metadata, so every rank throws the same error.
void compare(const std::vector<Meta>& metas);

// --- CommState (communicator.cpp)

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
  // The metadata exchanges this rank has made, and the collectives it would have exchanged for
  // had their arguments passed its checks: equal on every rank while the team is in step.
  std::uint32_t exchanges = 0;
  int splits = 0;
  int respecs = 0;  // with_backends() teams made, naming them
  // What with_backends() and mesh_teams() made, by spec and by mesh (BackendSpec::str,
  // DeviceMesh::to_string), kept for later calls (the same calls on every rank, so every rank
  // finds the same entries).
  std::map<std::string, std::shared_ptr<Communicator>> respecced;
  std::map<std::string, std::vector<std::shared_ptr<Communicator>>> mesh_teams;
  int boots = 0;
  std::shared_ptr<Health> health = std::make_shared<Health>();

  int size() const { return static_cast<int>(team.size()); }

  static std::shared_ptr<Communicator> make(std::unique_ptr<CommState> state) {
    return std::shared_ptr<Communicator>(new Communicator(std::move(state)));
  }

  // A child team that shares everything but its members and name.
  std::unique_ptr<CommState> child(std::vector<int> members, int new_rank,
                                   std::string child_name) const;

  // The backend's view of this team, set up on first use (collectively: every rank of the team
  // reaches it at the same operation).
  CommImpl& impl(CommunicatorBackend backend);

  // Before `backend` exists: through the store, else through another backend of the spec.
  void bootstrap_exchange(CommunicatorBackend backend, const void* mine, void* all,
                          std::size_t bytes);

  // All ranks' metadata through the backend, `mine` stamped with the next exchange number; throws
  // the mismatch on every rank (CommunicationFailure when the ranks are out of step).
  std::vector<Meta> exchange_meta(CommImpl& impl, const Meta& mine);

  void remember(const CommRecord& record);

  std::shared_ptr<Communicator> split(int color, int key, const std::vector<int>* group);
};

}  // namespace meshfuse::detail
