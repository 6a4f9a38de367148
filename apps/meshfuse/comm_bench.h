// `meshfuse comm-bench`: the time of one collective per message size, with the algorithm and bus
// bandwidths of nccl-tests, on the backend named (or the launcher's).
//
// Definitions (nccl-tests, doc/PERFORMANCE.md), n ranks, GB = 1e9 bytes:
//   size   the bytes of the larger buffer of one rank: all_reduce and broadcast the tensor,
//          all_gather the gathered output, reduce_scatter the input, all_to_all the input
//          (CommRecord::bytes)
//   time   per iteration the slowest rank's time, from a barrier to the call's completion (CPU:
//          the steady clock around the call and Work::wait after the barrier's; CUDA: events on
//          the stream behind the barrier's kernel and StreamTimer's hold, so that the host's
//          launch latency is left out); median and p20/p80 over the iterations after the warm-up
//   algbw  size / time
//   busbw  algbw x 2(n-1)/n for all_reduce; x (n-1)/n for all_gather, reduce_scatter and
//          all_to_all; x 1 for broadcast: the bandwidth each rank's link needs for the collective
//          under the ideal (ring) algorithm, comparable across n and with the hardware's peak
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

namespace meshfuse::cli {

struct CommBenchOptions {
  // local, gloo, mpi or nccl; empty: MESHFUSE_BACKEND, else mpi under mpirun, gloo under another
  // launcher, local without one.
  std::string backend;
  std::string op = "all_reduce";  // all_reduce | all_gather | reduce_scatter | broadcast |
                                  // all_to_all
  std::string min_bytes = "1K";   // a number of bytes, with K, M or G (powers of 1024)
  std::string max_bytes = "64M";
  std::string dtype = "f32";  // f32 | bf16
  int iters = 20;             // timed iterations per size
  int warmup = 5;
  std::string format = "table";  // table | csv | json
  int nranks = 0;                // --backend local: threads (0: 2); launched: must match the launch
  bool check = false;            // the cross-rank metadata check before each collective
  bool copy_bandwidth = true;    // rank 0 measures its device's copy bandwidth first
};

// Parses "4096", "1K", "64M", "1G" (also "1KiB", "1KB": powers of 1024). Error(InvalidArgument)
// naming `option` otherwise.
std::int64_t parse_bytes(const std::string& text, const std::string& option);

// Runs the bench; rank 0 prints the results to `out`. Returns 0. Throws meshfuse::Error for bad
// options (before communicating) and for communication failures.
int run_comm_bench(const CommBenchOptions& options, std::ostream& out);

}  // namespace meshfuse::cli
