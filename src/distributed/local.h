// The shared state of a LocalWorld (internal): what the local backend's ranks, threads of one
// process, meet through. local.cpp serves CPU tensors, local_cuda.cpp CUDA tensors.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "distributed/comm_impl.h"
#include "meshfuse/core/error.h"
#include "meshfuse/distributed/store.h"

namespace meshfuse::detail {

struct LocalTeam;      // local.cpp
struct LocalCudaTeam;  // local_cuda.cpp

struct LocalWorldState {
  explicit LocalWorldState(int size)
      : size(size),
        taken(static_cast<std::size_t>(size)),
        returned(static_cast<std::size_t>(size)) {}

  const int size;
  std::shared_ptr<HashStore> store = std::make_shared<HashStore>();
  std::mutex mutex;
  std::vector<bool> taken;  // ranks whose communicator has been handed out
  // The teams' meeting points by team name; the first rank of a team to arrive creates it.
  std::map<std::string, std::weak_ptr<LocalTeam>> teams;
  std::string aborted;  // why abort_local_world broke the world; empty while it has not
  std::vector<bool> returned;  // ranks done with their communicators (LocalWorld::rank_returned)
};

// Breaks every team of `world`, now and later: ranks waiting in a collective or a recv, and those
// that start one, fail with CommunicationFailure naming `why` (LocalWorld::abort).
void abort_local_world(LocalWorldState& world, const std::string& why);
// Breaks every team of `world` with world rank `rank` in it, now and later (rank_returned).
void local_rank_returned(LocalWorldState& world, int rank);

// A reusable barrier that gives every rank the pointer each rank posted. After a timeout it is
// broken for good: a late rank must not read pointers of ranks that have given up.
class Meeting {
 public:
  explicit Meeting(int size) : posted_(size), handed_(size) {}

  std::vector<const void*> meet(int rank, const void* mine, Deadline deadline) {
    std::unique_lock lock(mutex_);
    MESHFUSE_CHECK(!broken_, ErrorCode::CommunicationFailure, "local: {}",
                   why_.empty() ? "another rank of the team gave up after a timeout" : why_);
    const std::uint64_t generation = generation_;
    posted_[rank] = mine;
    if (++arrived_ == static_cast<int>(posted_.size())) {
      handed_ = posted_;
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return handed_;
    }
    // Woken by the deadline, or by a peer whose deadline came first: both are timeouts.
    changed_.wait_until(lock, deadline, [&] { return broken_ || generation_ != generation; });
    if (generation_ == generation) {
      if (!why_.empty()) fail(ErrorCode::CommunicationFailure, "local: {}", why_);
      broken_ = true;
      changed_.notify_all();
      fail(ErrorCode::Timeout, "local: {} of {} ranks arrived", arrived_, posted_.size());
    }
    return handed_;  // valid: the next generation needs this rank to arrive again
  }

  // Gives up: wakes the waiting ranks and refuses later arrivals, as timed out or, given `why`,
  // as a CommunicationFailure saying it (the first reason given stays).
  void abort(const std::string& why = {}) {
    {
      std::lock_guard lock(mutex_);
      if (why_.empty()) why_ = why;
      broken_ = true;
    }
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<const void*> posted_, handed_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool broken_ = false;
  std::string why_;
};

// The CUDA side of the local backend (local_cuda.cpp): a team's meeting point for CUDA operations,
// and one rank's view of it. Builds without CUDA never call them (the local backend serves only
// CPU tensors there) and have versions that throw Error(BackendUnavailable).
std::shared_ptr<LocalCudaTeam> make_local_cuda_team(int size);
void abort_local_cuda_team(LocalCudaTeam& team, const std::string& why);  // its collectives
std::unique_ptr<CommImpl> make_local_cuda_comm(const TeamContext& context,
                                               std::shared_ptr<LocalCudaTeam> team);

}  // namespace meshfuse::detail
