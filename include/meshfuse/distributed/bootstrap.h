// Where this process sits in a multi-process job, read from the environment of the launcher that
// started it, and the rendezvous store that goes with it.
//
// Launchers understood, in this order of precedence:
//   torchrun / meshfuse launch: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//                               MASTER_PORT
//   Open MPI (mpirun):          OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//                               OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE
//   Slurm (srun):               SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the tasks on this
//                               node from SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE ("4(x2)")
// MASTER_ADDR / MASTER_PORT are read under every launcher (mpirun and srun do not set them).
// No launcher: a single process, rank 0 of 1.
//
// The CUDA device of a rank is its LOCAL rank (cuda_device()), never its global rank.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "meshfuse/distributed/store.h"

namespace meshfuse {

enum class Launcher { None, Torchrun, OpenMpi, Slurm };

// "none", "torchrun", "openmpi", "slurm".
std::string_view to_string(Launcher launcher);

struct LaunchInfo {
  Launcher launcher = Launcher::None;
  int rank = 0;  // global rank, 0 <= rank < world_size
  int world_size = 1;
  int local_rank = 0;        // rank among the processes of this machine
  int local_world_size = 1;  // processes on this machine
  std::string master_addr;   // empty when not given
  int master_port = 0;       // 0 when not given

  // The CUDA device index of this rank: the local rank.
  int cuda_device() const { return local_rank; }
  // e.g. "torchrun rank 1/4 (local 1/4), master 127.0.0.1:29500".
  std::string str() const;
};

// Parses launch variables from `env` (name -> value). Throws Error(InvalidArgument) naming the
// variable when one is missing (e.g. RANK without WORLD_SIZE), not a number, or inconsistent
// (rank >= world size, local rank >= local world size, local world size > world size, a port
// outside 1..65535).
LaunchInfo parse_launch_env(const std::map<std::string, std::string>& env);

// parse_launch_env on this process's environment.
LaunchInfo launch_info_from_env();

// The rendezvous store of a launch:
//   MESHFUSE_STORE_PATH set      -> FileStore at that directory (shared by all ranks), its
//                                   keys under a hash of the launcher's job identity
//                                   (MESHFUSE_STORE_SECRET, which meshfuse launch makes per job;
//                                   TORCHELASTIC_RUN_ID and _RESTART_COUNT; SLURM_JOB_ID and
//                                   _STEP_ID; PMIX_NAMESPACE), so that a later job in the same
//                                   directory does not read this one's; without any, the
//                                   directory must be fresh for each job;
//   MASTER_ADDR and MASTER_PORT  -> TcpStore at MASTER_ADDR:MASTER_PORT, served by world rank 0
//                                   on MASTER_ADDR's interface (MESHFUSE_STORE_BIND: another
//                                   address, 0.0.0.0 for every one), with store_secret_from_env();
//                                   under torchrun's agent store
//                                   (TORCHELASTIC_USE_AGENT_STORE=True: torchrun's own store, whose
//                                   protocol meshfuse does not speak, holds MASTER_PORT) rank 0
//                                   serves on MASTER_PORT + 1;
//   neither                      -> nullptr (enough for mpi, which rendezvouses through mpirun,
//                                   and for a single process).
std::shared_ptr<Store> store_from_env(const LaunchInfo& launch,
                                      std::chrono::milliseconds timeout = std::chrono::minutes(5));

// The job's store secret: MESHFUSE_STORE_SECRET, else the content of MESHFUSE_STORE_SECRET_FILE
// (owned by this user, no group or other permissions; trailing newlines dropped). Error
// (InvalidArgument) saying how to set one when neither is set, or naming the file's problem.
std::string store_secret_from_env();

}  // namespace meshfuse
