// `meshfuse run`: one transformer MLP block and the language-model head of a model, written once
// against global shapes, run forward and backward by the MultiDeviceExecutor on N ranks, and
// checked against the same program on one device.
//
// The program (llama's layout; Megatron-LM's tensor and sequence parallelism on a 1-D mesh):
//   x [T, H] Shard(0)      h = rmsnorm(x, norm_weight)           gathered over tokens
//   gate, up [I, H] Shard(0)  a = swiglu(h gate^T, h up^T)         column-parallel
//   down [H, I] Shard(1)   y = x + a down^T                      row-parallel, reduce-scattered
//   head_weight [V, H] Shard(0), labels [T] Shard(0)
//                          loss = fused_linear_cross_entropy(rmsnorm(y, head_norm_weight),
//                                 head_weight, labels), mean, f32: vocabulary-parallel (each
//                                 rank its rows of the weight, a chunk of tokens at a time, the
//                                 row statistics all-gathered), on the gathered tokens
// then grad() for the gradients of the loss with respect to every weight and x.
//
// Without a launcher the ranks are threads of this process on the local backend (--ranks, default
// 4); under `meshfuse launch`, torchrun or mpirun one process per rank on the launcher's backend.
// Rank 0 also runs the program on one device, compares every output and gradient gathered from
// the ranks (normwise: max |sharded - single| / max |single|, against 1e-4 for f32 and 2e-2 for
// bf16, whose Partial terms are rounded to bf16 before they are summed), and prints per-rank
// time, time in communication, the bytes of each collective and the scaling efficiency
// (one-device time / (N x per-rank time)).
//
// --overlap collective|ring (--chunks, --streams) runs the stretches from an all_gather to a
// reduce_scatter chunk by chunk (exec/overlap.h) and reports each: comm alone and compute alone
// (their steps' times in a run without overlap, each step timed with the stream synchronised),
// sequential (their sum), overlapped (the stretch timed as one) and the overlap efficiency
// max(comm alone, compute alone) / overlapped.
//
// --backend local --device cuda runs the ranks as threads on that GPU, each with its own stream
// (the local backend's copies between them on the copy engines).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

namespace meshfuse::cli {

struct RunOptions {
  std::string model;        // a shipped model or a config.json path
  int ranks = 0;            // threads without a launcher (0: 4); launched: 0 or the world size
  std::string backend;      // local, gloo, mpi, nccl; empty: MESHFUSE_BACKEND or the launcher's
  std::int64_t tokens = 0;  // 0: 256 on the CPU, 4096 on CUDA
  std::string device = "cpu";
  std::string dtype = "bf16";    // bf16 or f32
  int repeats = 3;               // timed runs after one warm-up
  bool dump_plan = false;        // print rank 0's plan
  std::string format = "table";  // table or json
  std::string overlap = "none";  // none, collective or ring
  int chunks = 0;                // collective: chunks per part (0: the ranks)
  int streams = 2;               // CUDA: the executor's streams for the chunks
};

// Returns 0 when every output and gradient matches, 1 otherwise. Throws meshfuse::Error for bad
// options and failures.
int run_model(const RunOptions& options, std::ostream& out);

}  // namespace meshfuse::cli
