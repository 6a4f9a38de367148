// The shared state of a LocalWorld (internal): what the local backend's ranks, threads of one
// process, meet through.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "meshfuse/distributed/store.h"

namespace meshfuse::detail {

struct LocalTeam;  // local.cpp

struct LocalWorldState {
  explicit LocalWorldState(int size) : size(size), taken(static_cast<std::size_t>(size)) {}

  const int size;
  std::shared_ptr<HashStore> store = std::make_shared<HashStore>();
  std::mutex mutex;
  std::vector<bool> taken;  // ranks whose communicator has been handed out
  // The teams' meeting points by team name; the first rank of a team to arrive creates it.
  std::map<std::string, std::weak_ptr<LocalTeam>> teams;
};

}  // namespace meshfuse::detail
