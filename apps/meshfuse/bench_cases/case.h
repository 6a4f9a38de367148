// What one op of `meshfuse bench` is: a "bench case" allocates the op's inputs at the model's
// shapes and hands back its directions (forward, backward), each a timed call, the work it does
// (bytes moved or flops) and a check against the `reference` backend on the same inputs.
//
// One op family per file in bench_cases/; all_cases() (cases.cpp) lists them in the order of a
// transformer layer.
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
  DType dtype = DType::BF16;
  Device device{};
};

struct Tolerance {
  double atol = 0;
  double rtol = 0;
};

// Elementwise and row-wise ops: testing::default_tolerance(dtype) (about 4 ulps of the dtype) as
// both atol and rtol.
Tolerance elementwise_tolerance(DType dtype);
// A product reduced over k terms of std-normal inputs has magnitude ~sqrt(k) and fp32 accumulation
// error growing with it: atol = tol(dtype) * sqrt(k), rtol = tol(dtype).
Tolerance reduction_tolerance(DType dtype, std::int64_t k);

// One output of a direction compared with the reference.
struct Comparison {
  std::string name;  // the output, e.g. "grad_gate"
  testing::Diff diff;
  Tolerance tolerance;
};

// compare() of `actual` against `expected` with `tolerance`.
Comparison compare_output(std::string name, const TensorView& actual, const TensorView& expected,
                          Tolerance tolerance);

// One direction of one op, ready to run on the backend being measured.
struct Direction {
  std::string kernel;     // the registered kernel, e.g. "swiglu_backward"
  std::string direction;  // "forward" or "backward"
  std::string shape;      // e.g. "gate, up: [512, 8192]"
  // Memory-bound ops: bytes moved per call, and the formula (BENCHMARKING.md) that gave them.
  double bytes = 0;
  std::string bytes_formula;
  // GEMMs: 2*M*N*K per call, and the same product through plain BLAS (OpenBLAS sgemm) to rate it.
  double flops = 0;
  std::function<void()> blas{};
  // Bytes of all tensors one call touches (for "fits in the cache" notes); 0: use `bytes`.
  double working_set = 0;
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
};

// Every case this build has, in the order of a transformer layer (cases.cpp).
std::vector<BenchCase> all_cases();

// The op families, one file each.
std::vector<BenchCase> swiglu_cases();

// --- helpers for the cases ------------------------------------------------------------------

// A tensor of std-normal values (BENCHMARKING.md: random inputs) on the setup's device, of the
// setup's dtype unless given; `seed` makes each input different.
Tensor random_tensor(const BenchSetup& setup, Shape shape, std::uint64_t seed,
                     std::optional<DType> dtype = {});
// An uninitialised output on the setup's device.
Tensor output_tensor(const BenchSetup& setup, Shape shape, std::optional<DType> dtype = {});
// The first `rows` rows (dim 0) of t.
TensorView first_rows(const TensorView& t, std::int64_t rows);
// Runs f with the `reference` backend forced on this thread.
void on_reference(const std::function<void()>& f);
// "[a, b]" joined as "name: [a, b]" pairs: shape_text({{"x", x}, {"w", w}}).
std::string shape_text(const std::vector<std::pair<std::string, Shape>>& parts);
// "reference checked on the first R of N rows (...)" when R < N, else nothing.
std::vector<std::string> rows_note(std::int64_t checked, std::int64_t rows, std::string_view why);

}  // namespace meshfuse::cli
