// Launch information from the environment of torchrun, Open MPI and Slurm; the rendezvous store.
#include "meshfuse/distributed/bootstrap.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>

#include "meshfuse/core/error.h"

extern char** environ;

namespace meshfuse {

std::string_view to_string(Launcher launcher) {
  switch (launcher) {
    case Launcher::None:
      return "none";
    case Launcher::Torchrun:
      return "torchrun";
    case Launcher::OpenMpi:
      return "openmpi";
    case Launcher::Slurm:
      return "slurm";
  }
  return "?";
}

std::string LaunchInfo::str() const {
  std::string s = fmt::format("{} rank {}/{} (local {}/{})", to_string(launcher), rank, world_size,
                              local_rank, local_world_size);
  if (!master_addr.empty()) s += fmt::format(", master {}:{}", master_addr, master_port);
  return s;
}

namespace {

using Env = std::map<std::string, std::string>;

std::optional<std::string> lookup(const Env& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

// A non-negative integer, or InvalidArgument naming the variable. `text` may carry a suffix
// after the number only when allow_suffix (Slurm's "4(x2)").
int to_int(const std::string& name, const std::string& text, bool allow_suffix = false) {
  int value = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  MESHFUSE_CHECK(
      ec == std::errc() && value >= 0 && (allow_suffix || end == text.data() + text.size()),
      ErrorCode::InvalidArgument, "launch environment: {}='{}' is not a non-negative integer", name,
      text);
  return value;
}

// Entry `node` of Slurm's tasks per node, "4(x2),3" meaning 4, 4, 3 (nodes in SLURM_NODEID
// order); -1 past the end.
int slurm_tasks_on(const std::string& name, const std::string& list, int node) {
  std::size_t at = 0;
  while (at < list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const std::string entry = list.substr(at, comma - at);
    const int tasks = to_int(name, entry, true);
    const std::size_t x = entry.find("(x");
    const int times = x == std::string::npos ? 1 : to_int(name, entry.substr(x + 2), true);
    if (node < times) return tasks;
    node -= times;
    at = comma + 1;
  }
  return -1;
}

int require(const Env& env, const std::string& name, const std::string& because) {
  const std::optional<std::string> v = lookup(env, name);
  MESHFUSE_CHECK(v.has_value(), ErrorCode::InvalidArgument,
                 "launch environment: {} is set but {} is missing", because, name);
  return to_int(name, *v);
}

int optional_int(const Env& env, const std::string& name, int fallback) {
  const std::optional<std::string> v = lookup(env, name);
  return v ? to_int(name, *v) : fallback;
}

}  // namespace

LaunchInfo parse_launch_env(const Env& env) {
  LaunchInfo info;
  // The variables that name each launcher's ranks, in order of precedence.
  struct Names {
    Launcher launcher;
    const char *rank, *size, *local_rank, *local_size;
  };
  static const Names kLaunchers[] = {
      {Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {Launcher::OpenMpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
  };
  for (const Names& n : kLaunchers) {
    if (!lookup(env, n.rank)) continue;
    info.launcher = n.launcher;
    info.rank = to_int(n.rank, *lookup(env, n.rank));
    info.world_size = require(env, n.size, n.rank);
    if (n.local_size) {
      info.local_rank = optional_int(env, n.local_rank, info.world_size == 1 ? 0 : -1);
      info.local_world_size = optional_int(env, n.local_size, info.world_size);
    } else {
      // Slurm: --ntasks-per-node's number, else this node's (SLURM_NODEID) entry of
      // SLURM_TASKS_PER_NODE, e.g. "4(x2),3".
      info.local_rank = require(env, n.local_rank, n.rank);
      if (const auto uniform = lookup(env, "SLURM_NTASKS_PER_NODE"))
        info.local_world_size = to_int("SLURM_NTASKS_PER_NODE", *uniform);
      else if (const auto per_node = lookup(env, "SLURM_TASKS_PER_NODE"))
        info.local_world_size =
            slurm_tasks_on("SLURM_TASKS_PER_NODE", *per_node, optional_int(env, "SLURM_NODEID", 0));
      else
        info.local_world_size = info.world_size;
    }
    MESHFUSE_CHECK(info.local_rank >= 0, ErrorCode::InvalidArgument,
                   "launch environment: {} is set but {} is missing (the CUDA device of a rank "
                   "is its local rank)",
                   n.rank, n.local_rank);
    MESHFUSE_CHECK(info.world_size >= 1 && info.rank < info.world_size, ErrorCode::InvalidArgument,
                   "launch environment: {}={} is not below {}={}", n.rank, info.rank, n.size,
                   info.world_size);
    MESHFUSE_CHECK(info.local_world_size >= 1 && info.local_world_size <= info.world_size &&
                       info.local_rank < info.local_world_size,
                   ErrorCode::InvalidArgument,
                   "launch environment: local rank {} of {} does not fit a world of {} ({}, {})",
                   info.local_rank, info.local_world_size, info.world_size, n.local_rank,
                   n.local_size ? n.local_size : "SLURM_NTASKS_PER_NODE");
    break;
  }
  const std::optional<std::string> addr = lookup(env, "MASTER_ADDR");
  const std::optional<std::string> port = lookup(env, "MASTER_PORT");
  MESHFUSE_CHECK(addr.has_value() == port.has_value(), ErrorCode::InvalidArgument,
                 "launch environment: {} is set but {} is missing",
                 addr ? "MASTER_ADDR" : "MASTER_PORT", addr ? "MASTER_PORT" : "MASTER_ADDR");
  if (addr) {
    info.master_addr = *addr;
    info.master_port = to_int("MASTER_PORT", *port);
    MESHFUSE_CHECK(info.master_port >= 1 && info.master_port <= 65535, ErrorCode::InvalidArgument,
                   "launch environment: MASTER_PORT={} is outside 1..65535", info.master_port);
  }
  return info;
}

LaunchInfo launch_info_from_env() {
  Env env;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const std::size_t eq = entry.find('=');
    if (eq != std::string::npos) env.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return parse_launch_env(env);
}

std::string store_secret_from_env() {
  if (const char* secret = std::getenv("MESHFUSE_STORE_SECRET"); secret && *secret) return secret;
  const char* file = std::getenv("MESHFUSE_STORE_SECRET_FILE");
  MESHFUSE_CHECK(file && *file, ErrorCode::InvalidArgument,
                 "rendezvous store: no job secret: set MESHFUSE_STORE_SECRET to the same random "
                 "string in every process of the job (e.g. export MESHFUSE_STORE_SECRET=$(od -An "
                 "-N16 -tx1 /dev/urandom | tr -d ' \\n') before torchrun, mpirun or srun), or "
                 "MESHFUSE_STORE_SECRET_FILE to a file only you can read; meshfuse launch sets one");
  // Checked on the open file itself, so that what is read is what was checked.
  const int fd = ::open(file, O_RDONLY | O_CLOEXEC);
  MESHFUSE_CHECK(fd >= 0, ErrorCode::InvalidArgument,
                 "rendezvous store: MESHFUSE_STORE_SECRET_FILE={}: {}", file, std::strerror(errno));
  struct stat st {};
  const bool owned = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::getuid() &&
                     (st.st_mode & (S_IRWXG | S_IRWXO)) == 0;
  std::string secret;
  char buf[4096];
  for (ssize_t n; owned && (n = ::read(fd, buf, sizeof(buf))) > 0 && secret.size() < 65536;)
    secret.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  MESHFUSE_CHECK(owned, ErrorCode::InvalidArgument,
                 "rendezvous store: MESHFUSE_STORE_SECRET_FILE={} must be a file of this user "
                 "that nobody else can read (chmod 600), got mode {:o}",
                 file, st.st_mode & 07777);
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  MESHFUSE_CHECK(!secret.empty(), ErrorCode::InvalidArgument,
                 "rendezvous store: MESHFUSE_STORE_SECRET_FILE={} is empty", file);
  return secret;
}

namespace {

// The variables `names` that the environment sets, as "NAME=value" lines.
std::string variables(std::initializer_list<const char*> names) {
  std::string set;
  for (const char* name : names)
    if (const char* value = std::getenv(name); value && *value)
      set += fmt::format("{}={}\n", name, value);
  return set;
}

// What sets this job apart from others and is the same in every one of its processes: meshfuse
// launch's per-launch id, the user's MESHFUSE_RUN_ID, torchrun's run id (a static torchrun's is
// "none"), Slurm's job, PMIx's namespace; empty when the environment has none. Not torchrun's
// restart count (an agent whose workers did not fail keeps its count) nor Slurm's step (mpirun's
// remote ranks inherit their daemons' step).
std::string job_identity() {
  return variables({"MESHFUSE_LAUNCH_ID", "MESHFUSE_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                    "PMIX_NAMESPACE"});
}

// Keys of earlier jobs stay in a store directory and would be read as this job's: this job's go
// under its identity, restart, step and secret, hashed; no prefix when the environment has none.
std::string job_namespace() {
  const std::string job = job_identity() + variables({"TORCHELASTIC_RESTART_COUNT", "SLURM_STEP_ID",
                                                      "MESHFUSE_STORE_SECRET"});
  return job.empty() ? "" : fmt::format("job-{:016x}", std::hash<std::string>{}(job));
}

}  // namespace

std::shared_ptr<Store> store_from_env(const LaunchInfo& launch, std::chrono::milliseconds timeout) {
  if (const char* path = std::getenv("MESHFUSE_STORE_PATH"); path && *path) {
    auto store = std::make_shared<FileStore>(path, timeout);
    const std::string job = job_namespace();
    if (job.empty()) return store;
    return std::make_shared<PrefixStore>(job, std::move(store));
  }
  if (launch.master_addr.empty()) return nullptr;
  // torchrun's agent holds MASTER_PORT with its own store (c10d's protocol): serve next to it.
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool beside_agent = agent && std::string_view(agent) == "True";
  MESHFUSE_CHECK(!beside_agent || launch.master_port < 65535, ErrorCode::InvalidArgument,
                 "rendezvous store: under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE="
                 "True) meshfuse serves on MASTER_PORT + 1, and MASTER_PORT is 65535: choose a "
                 "lower port");
  const char* bind = std::getenv("MESHFUSE_STORE_BIND");
  // The identity is proven with the secret: a rank of another job that shares the secret and
  // port (an exported secret, a fixed MASTER_PORT) is refused instead of joining this one.
  return std::make_shared<TcpStore>(launch.master_addr, launch.master_port + (beside_agent ? 1 : 0),
                                    launch.rank == 0, store_secret_from_env(), timeout,
                                    bind ? bind : "", job_identity());
}

}  // namespace meshfuse
