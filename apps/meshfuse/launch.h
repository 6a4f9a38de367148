// `meshfuse launch`: N local processes with the torchrun environment, their output forwarded
// line by line with the rank in front, and all of them stopped when one fails.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "meshfuse/distributed/bootstrap.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse::cli {

struct LaunchOptions {
  int nprocs = 1;
  std::string backend;               // exported as MESHFUSE_BACKEND when not empty
  int master_port = 0;               // 0: a free port on 127.0.0.1
  double grace_s = 5;                // SIGTERM -> SIGKILL delay when stopping the other ranks
  bool prefix = true;                // "[rankN]: " in front of each output line
  std::vector<std::string> command;  // the program and its arguments
};

// The environment of rank `rank` of `world` local ranks, torchrun's names:
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, the
// store's MESHFUSE_STORE_SECRET, MESHFUSE_LAUNCH_ID (the launch's identity, which the store's
// handshake proves with the secret, so that ranks of two launches that share an exported secret
// and a port cannot join each other), and MESHFUSE_BACKEND when `backend` is not empty. Returned
// as "NAME=value" strings.
std::vector<std::string> launch_env(int rank, int world, int master_port,
                                    const std::string& backend, const std::string& secret,
                                    const std::string& launch_id);

// 128 random bits in hex.
std::string random_id();

// The job's store secret: MESHFUSE_STORE_SECRET when the launcher was given one, else
// random_id().
std::string job_secret();

// Starts the ranks, each in its own process group (so a rank's children are stopped with it) with
// stdin from /dev/null (rank 0: ours, unless a terminal), forwards their stdout and stderr to ours
// line by line, and waits for them all. When one exits non-zero or dies by a signal, the others get
// SIGTERM and, `grace_s` later, SIGKILL; SIGINT, SIGTERM and SIGHUP (unless ignored, as under
// nohup) sent to the launcher are forwarded to every rank the same way. Returns 0 when every rank
// exits 0; otherwise the first failure's exit status (128 + signal number for a signal; 128 + the
// launcher's signal when interrupted before any failure), having named it on stderr. Throws
// meshfuse::Error for bad options or when a process cannot be started (once the ranks started are
// stopped).
int run_launch(const LaunchOptions& options);

// The communicator backend of a command that runs ranks (comm-bench, run): `name` (its --backend),
// or when empty MESHFUSE_BACKEND, else mpi under mpirun, gloo under another launcher, local
// without one. A spec ("cpu:gloo,cuda:nccl") gives its backend for `device` (none given: cuda
// where the spec serves it and this machine has a CUDA device, else cpu). local runs its ranks as
// threads of this process (their number given by the option `ranks_option`, whose value is
// `ranks`, 0 when not given), so it needs a process started without a launcher. The other
// backends' ranks come from the launcher: `ranks`, when given, must be the job's number, and a
// process started without one is a job of one rank, which only `ranks_option 1` asks for
// (otherwise it would quietly run one rank where local runs several). Throws Error naming
// --backend or MESHFUSE_BACKEND: InvalidArgument for an unknown name, a spec without the device,
// local under a launcher, or ranks the launcher did not start (naming the launchers that start
// the backend's ranks: mpi's, mpirun alone); BackendUnavailable for a backend this build lacks.
CommunicatorBackend command_backend(const std::string& name, const LaunchInfo& launch,
                                    std::optional<DeviceType> device,
                                    const std::string& ranks_option, int ranks);

}  // namespace meshfuse::cli
