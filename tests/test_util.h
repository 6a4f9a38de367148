// Helpers for the GoogleTest suite.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "meshfuse/core/error.h"
#include "meshfuse/core/kernel_backend.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/testing.h"

namespace meshfuse::test {

inline Tensor randn(Shape shape, DType dtype, std::uint64_t seed, double std = 1.0) {
  Tensor t(std::move(shape), dtype);
  testing::fill_normal(t, seed, 0.0, std);
  return t;
}

inline Tensor full(Shape shape, DType dtype, double value) {
  Tensor t(std::move(shape), dtype);
  fill(t, value);
  return t;
}

inline Tensor empty_like(const TensorView& t) { return Tensor(t.shape(), t.dtype()); }

// A CPU copy of t in `dtype`: f32 inputs as f64 give the reference the exact values that an f32
// result is measured against.
inline Tensor converted(const TensorView& t, DType dtype) {
  Tensor out(t.shape(), dtype);
  copy(t, out);
  return out;
}

// A transposed (non-contiguous) copy of a 2-D tensor holding the same values: the storage is
// (cols, rows) and the returned view swaps the dims back.
struct NonContiguous {
  Tensor storage;
  TensorView view;
};
inline NonContiguous non_contiguous(const TensorView& t) {
  NonContiguous nc{Tensor(Shape{t.size(1), t.size(0)}, t.dtype()), {}};
  nc.view = nc.storage.view().transpose(0, 1);
  copy(t, nc.view);
  return nc;
}

// EXPECT that actual matches expected within tol (abs and rel) and that NaN/inf agree.
inline void expect_close(const TensorView& actual, const TensorView& expected, double tol,
                         const std::string& what) {
  const testing::Diff d = testing::compare(actual, expected, tol, tol);
  EXPECT_EQ(d.violations, 0) << what << ": max abs err " << d.max_abs_err << ", max rel err "
                             << d.max_rel_err << ", non-finite mismatches "
                             << d.mismatched_nonfinite << " (tol " << tol << ")";
}

inline void expect_close(const TensorView& actual, const TensorView& expected,
                         const std::string& what) {
  expect_close(actual, expected, testing::default_tolerance(expected.dtype()), what);
}

inline const std::vector<DType> kFloatDTypes = {DType::F32, DType::F64, DType::BF16, DType::F16};

inline std::string dtype_name(const ::testing::TestParamInfo<DType>& info) {
  return std::string(to_string(info.param));
}

// EXPECT that `f` throws meshfuse::Error with `code` and a message containing every needle.
template <typename F>
void expect_error(F&& f, ErrorCode code, std::vector<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message '" << e.what() << "' lacks '" << n << "'";
  }
}

}  // namespace meshfuse::test

namespace meshfuse::test {

// CUDA tests call this first: skips the test when no CUDA device is present (CI, CPU machines).
#define MESHFUSE_REQUIRE_CUDA()                                           \
  do {                                                                    \
    if (::meshfuse::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (false)

inline const Device kCuda{DeviceType::CUDA, 0};

// The cross-backend harness (in the spirit of ggml's test-backend-ops): each op's test file runs
// its cases on every (backend, device) the build has, with the reference backend on the CPU as
// the oracle. A target whose device is absent (no GPU: CI) is skipped, never dropped, so every
// build lists the same cases.
struct Target {
  KernelBackend backend;
  Device device;
};

inline std::string target_name(const Target& t) {
  // cpu, cuda; reference on CUDA tensors (host copies) is "reference_cuda".
  std::string name(to_string(t.backend));
  if (t.backend == KernelBackend::Reference && t.device.type == DeviceType::CUDA) name += "_cuda";
  return name;
}

// The optimised backends on their own devices: cpu on the CPU, cuda on GPU 0.
inline std::vector<Target> kernel_targets() {
  return {{KernelBackend::CPU, Device{}}, {KernelBackend::CUDA, kCuda}};
}
// kernel_targets() and the reference backend on the CPU and on CUDA tensors (host staging):
// for cases with known values, where the reference is checked too.
inline std::vector<Target> all_targets() {
  return {{KernelBackend::Reference, Device{}},
          {KernelBackend::CPU, Device{}},
          {KernelBackend::Reference, kCuda},
          {KernelBackend::CUDA, kCuda}};
}

// One parameter of a cross-backend test: where it runs and on which dtype.
struct OpCase {
  Target target;
  DType dtype;
};

inline std::vector<OpCase> op_cases(const std::vector<Target>& targets,
                                    const std::vector<DType>& dtypes = kFloatDTypes) {
  std::vector<OpCase> out;
  for (const Target& t : targets)
    for (DType d : dtypes) out.push_back({t, d});
  return out;
}

// "cpu_f32", "cuda_bf16", "reference_cuda_f16": CUDA cases carry "cuda" in their names, which
// scripts/gpu_check.sh's sanitizer filter selects.
inline std::string op_case_name(const ::testing::TestParamInfo<OpCase>& info) {
  return target_name(info.param.target) + "_" + std::string(to_string(info.param.dtype));
}
inline std::string target_param_name(const ::testing::TestParamInfo<Target>& info) {
  return target_name(info.param);
}

// How GoogleTest prints a parameter (else it dumps the struct's bytes).
inline void PrintTo(const Target& t, std::ostream* os) { *os << target_name(t); }
inline void PrintTo(const OpCase& c, std::ostream* os) {
  *os << target_name(c.target) << " " << to_string(c.dtype);
}

// Skips the current test when the target's device is absent.
#define MESHFUSE_REQUIRE_TARGET(target)                                               \
  do {                                                                                \
    if ((target).device.type == ::meshfuse::DeviceType::CUDA &&                      \
        ::meshfuse::cuda_device_count() == 0)                                         \
      GTEST_SKIP() << "no CUDA device";                                               \
  } while (false)

// A copy of `t` on `device` (undefined stays undefined).
inline Tensor on(const TensorView& t, Device device, const Stream& stream = {}) {
  if (!t.defined()) return {};
  Tensor out(t.shape(), t.dtype(), device, stream);
  copy(t, out, stream);
  return out;
}

inline Tensor to_cuda(const TensorView& t, const Stream& stream = {}) {
  Tensor out(t.shape(), t.dtype(), kCuda, stream);
  copy(t, out, stream);
  return out;
}

inline Tensor to_cpu(const TensorView& t, const Stream& stream = {}) {
  Tensor out(t.shape(), t.dtype());
  copy(t, out, stream);
  return out;
}

}  // namespace meshfuse::test

namespace meshfuse::test {

// A CPU tensor of `shape` and `dtype` holding `values` (row-major), converted from double.
inline Tensor from(Shape shape, DType dtype, std::initializer_list<double> values) {
  Tensor f64(std::move(shape), DType::F64), t(f64.shape(), dtype);
  std::copy(values.begin(), values.end(), f64.data_ptr<double>());
  copy(f64, t);
  return t;
}

// The values of a CPU tensor as doubles, row-major.
inline std::vector<double> values(const TensorView& t) {
  Tensor f64(t.shape(), DType::F64);
  copy(t, f64);
  return {f64.data_ptr<double>(), f64.data_ptr<double>() + f64.numel()};
}

// Expects every element of `actual` (an f32 result, any device's copy on the CPU) within `ulps`
// units in the last place of f32 (a relative 2^-23 each) of `truth`, the f64 reference; reports
// the largest relative error over the elements whose truth is nonzero.
inline void expect_within_f32_ulps(const TensorView& actual, const TensorView& truth, double ulps,
                                   const std::string& what) {
  const testing::Diff d = testing::compare(actual, truth, 0x1p-126, ulps * 0x1p-23);
  const std::vector<double> a = values(actual), e = values(truth);
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (e[i] != 0 && std::isfinite(e[i]))
      worst = std::max(worst, std::abs(a[i] - e[i]) / std::abs(e[i]));
  EXPECT_EQ(d.violations, 0) << what << ": max relative error " << worst << " ("
                             << worst / 0x1p-23 << " of 2^-23)";
}

// Labels uniform in [0, vocab) with every third row (0, 3, 6, ...) ignored (-100).
inline Tensor make_labels(std::int64_t rows, std::int64_t vocab, DType dtype,
                          std::uint64_t seed) {
  Tensor labels({rows}, dtype);
  testing::fill_uniform_int(labels, seed, 0, vocab);
  for (std::int64_t i = 0; i < rows; i += 3)
    copy(full({1}, DType::F64, -100), labels.view().narrow(0, i, 1));
  return labels;
}

}  // namespace meshfuse::test
