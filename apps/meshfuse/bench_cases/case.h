// What one op of `meshfuse bench` is: a "bench case" allocates the op's inputs at the model's
// shapes and hands back its directions (forward, backward), each a timed call, the work it does
// (bytes moved or flops) and a check against the `reference` backend on the same inputs.
//
// One op family per file in bench_cases/; all_cases() (cases.cpp) lists the families in the order
// they first appear in a transformer layer.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "meshfuse/core/device.h"
#include "meshfuse/core/dtype.h"
#include "meshfuse/core/kernel_backend.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/testing.h"
#include "model_config.h"

namespace meshfuse::cli {

// What the bench knows when it builds a case.
struct BenchSetup {
  ModelConfig model;
  std::int64_t tokens = 0;
  // Steps per sequence of the recurrent and sequence ops (--seq-len); 0: each case's default.
  std::int64_t seq_len = 0;
  DType dtype = DType::BF16;
  Device device{};
};

struct Tolerance {
  double atol = 0;
  double rtol = 0;
};

// The check of an output whose values (and partial sums) have typical size `magnitude`, each a
// sum of `terms` products accumulated in fp32 (inputs are standard normal):
//   |ours - reference| <= atol + tol·|reference|,   atol = magnitude · max(tol, 4·2^-24·√terms)
// with tol = testing::default_tolerance(dtype), about 4 ulps of the dtype (1e-5 f32, 2e-3 f16,
// 2e-2 bf16): the output's own rounding, or the fp32 accumulation error, which grows as √terms,
// whichever is larger. atol is at least 4 steps of the dtype's subnormals (f16 probabilities over
// a large vocabulary are subnormal).
Tolerance tolerance(DType dtype, double magnitude = 1.0, std::int64_t terms = 1);
// √k, the typical size of a sum of k products of standard normal values.
double sqrt_of(std::int64_t k);

// One output of a direction compared with the reference.
struct Comparison {
  std::string name;  // the output, e.g. "grad_gate"
  testing::Diff diff;
  Tolerance tolerance;
};

// testing::compare() of `actual` against `expected` with `tol`; with `rows`, only those rows
// (dim 0) are compared, for outputs too large to compare whole in a few seconds.
Comparison compare_output(std::string name, const TensorView& actual, const TensorView& expected,
                          Tolerance tol);
Comparison compare_output(std::string name, const TensorView& actual, const TensorView& expected,
                          Tolerance tol, const std::vector<std::int64_t>& rows);

// One direction of one op, ready to run on the backend being measured.
struct Direction {
  std::string kernel{};     // the registered kernel, e.g. "swiglu_backward"
  std::string direction{};  // "forward" or "backward"
  std::string shape{};      // e.g. "gate, up: [512, 8192]"
  // Memory-bound ops: bytes moved per call. GEMMs: flops per call (2·M·N·K each), and the same
  // products through the vendor GEMM (blas.h) to rate them against.
  double bytes = 0;
  double flops = 0;
  std::string formula{};  // what gave bytes or flops (docs/BENCHMARKING.md), e.g. "3·N·I·e (...)"
  std::function<void()> blas{};
  // Bytes of all tensors one call touches (for "fits in the cache" notes); 0: use `bytes`.
  double working_set = 0;
  // Recurrences: the sequential steps of one call; the record's notes give the time per step.
  std::int64_t steps = 0;
  std::function<void()> run{};  // one call of the op
  // Runs the `reference` backend on the inputs of the last call (or their first rows) and
  // compares the outputs; called after the timed calls.
  std::function<std::vector<Comparison>()> check{};
  std::vector<std::string> notes{};  // e.g. "reference checked on the first 64 of 1024 rows"
};

// One op of the bench.
struct BenchCase {
  std::string name;                  // its name in --ops, e.g. "swiglu", "linear_q"
  std::string group;                 // a name selecting several cases, e.g. "linear"; or empty
  std::vector<std::string> kernels;  // the kernels it calls (checked for the backend up front)
  std::function<std::vector<Direction>(const BenchSetup&)> make;
  // Part of a transformer layer, run when --ops is not given; the others (recurrent and sequence
  // ops, at their own sizes) run only when --ops names them.
  bool in_layer = true;
  // The dtype its kernels run on when that is not --dtype (continuous_count counts i32 ids).
  std::optional<DType> kernel_dtype{};
};

// Every case this build has, family by family (cases.cpp).
std::vector<BenchCase> all_cases();

// The op families, one file each.
std::vector<BenchCase> rmsnorm_cases();
std::vector<BenchCase> linear_cases();
std::vector<BenchCase> swiglu_cases();
std::vector<BenchCase> softmax_cases();
std::vector<BenchCase> cross_entropy_cases();
std::vector<BenchCase> fused_linear_cross_entropy_cases();
// Outside a transformer layer (in_layer = false), at their own sizes.
std::vector<BenchCase> recurrent_cases();
std::vector<BenchCase> pack_sequence_cases();

// --- helpers for the cases ------------------------------------------------------------------

// A tensor of normal(0, std) values (docs/BENCHMARKING.md: random inputs) on the setup's device, of
// the setup's dtype unless given; `seed` makes each input different.
Tensor random_tensor(const BenchSetup& setup, Shape shape, std::uint64_t seed,
                     std::optional<DType> dtype = {}, double std = 1.0);
// An f32 copy of a CPU tensor (f32, bf16 or f16), widened in parallel: the vendor GEMM's
// operands, for the same inputs as ours (meshfuse::copy converts one element at a time).
Tensor widened_to_f32(const Tensor& t);
// An uninitialised output on the setup's device.
Tensor output_tensor(const BenchSetup& setup, Shape shape, std::optional<DType> dtype = {});
// The first `rows` rows (dim 0) of t.
TensorView first_rows(const TensorView& t, std::int64_t rows);
// Runs f with the `reference` backend forced on this thread.
void on_reference(const std::function<void()>& f);
// "[a, b]" joined as "name: [a, b]" pairs: shape_text({{"x", x}, {"w", w}}).
std::string shape_text(const std::vector<std::pair<std::string, Shape>>& parts);
// The ops over the whole vocabulary (softmax, cross-entropy) hold tokens x V values per tensor,
// 263 MB per bf16 tensor for 1024 tokens of a 128k vocabulary: on the CPU they run on at most this
// many rows (on a GPU on all tokens, as a training step does), and the reference (one double exp
// per value) checks the first kVocabCheckRows of them.
inline constexpr std::int64_t kMaxVocabRows = 1024;
inline constexpr std::int64_t kVocabCheckRows = 32;
// The tokens, or on the CPU min(tokens, kMaxVocabRows), adding a note to `notes` when that is
// fewer than the tokens.
std::int64_t vocab_rows(const BenchSetup& setup, std::vector<std::string>& notes);

// The dtype of the losses and their upstream gradients: f32 (f64 for f64), as training loops log
// and sum them, whatever the logits' dtype.
inline DType loss_dtype(const BenchSetup& setup) {
  return setup.dtype == DType::F64 ? DType::F64 : DType::F32;
}

// Adds "reference checked on the first R of N rows (why)" to `notes` when R < N.
void note_rows_checked(std::vector<std::string>& notes, std::int64_t checked, std::int64_t rows,
                       std::string_view why);

}  // namespace meshfuse::cli
