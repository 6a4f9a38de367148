#include "ops/common.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace meshfuse::detail {

void check_defined(std::string_view op, std::string_view name, const TensorView& t) {
  MESHFUSE_CHECK(t.defined(), ErrorCode::InvalidArgument, "{}: argument '{}' is required", op,
                 name);
}

void check_dtype(std::string_view op, std::string_view name, const TensorView& t,
                 std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype() == d) return;
  std::string names;
  for (DType d : allowed) names += fmt::format("{}{}", names.empty() ? "" : " or ", to_string(d));
  fail(ErrorCode::DTypeMismatch, "{}: '{}' must be {}, got {}", op, name, names,
       to_string(t.dtype()));
}

void check_same_dtype(std::string_view op, std::string_view name, const TensorView& t,
                      DType expected, std::string_view expected_from) {
  MESHFUSE_CHECK(t.dtype() == expected, ErrorCode::DTypeMismatch,
                 "{}: '{}' must have the dtype of '{}' ({}), got {}", op, name, expected_from,
                 to_string(expected), to_string(t.dtype()));
}

void check_same_or_f32(std::string_view op, std::string_view name, const TensorView& t,
                       DType expected, std::string_view expected_from) {
  const bool sixteen_bit = is_sixteen_bit(expected);
  MESHFUSE_CHECK(t.dtype() == expected || (sixteen_bit && t.dtype() == DType::F32),
                 ErrorCode::DTypeMismatch, "{}: '{}' must have the dtype of '{}' ({}){}, got {}",
                 op, name, expected_from, to_string(expected), sixteen_bit ? " or f32" : "",
                 to_string(t.dtype()));
}

void check_float(std::string_view op, std::string_view name, const TensorView& t) {
  check_defined(op, name, t);
  check_dtype(op, name, t, {DType::F32, DType::F64, DType::BF16, DType::F16});
}

void check_dtype_of(std::string_view op, std::string_view name, const TensorView& t,
                    const TensorView& like, std::string_view like_name) {
  check_defined(op, name, t);
  check_same_dtype(op, name, t, like.dtype(), like_name);
}

void check_like(std::string_view op, std::string_view name, const TensorView& t,
                const TensorView& like, std::string_view like_name) {
  check_dtype_of(op, name, t, like, like_name);
  check_shape(op, name, t, like.shape());
}

void check_logits_multiplier(std::string_view op, double logits_multiplier) {
  MESHFUSE_CHECK(std::isfinite(logits_multiplier), ErrorCode::InvalidArgument,
                 "{}: logits_multiplier must be finite, got {}", op, logits_multiplier);
}

void check_rank(std::string_view op, std::string_view name, const TensorView& t,
                std::int64_t rank) {
  MESHFUSE_CHECK(t.dim() == rank, ErrorCode::InvalidArgument,
                 "{}: '{}' must have {} dimension{}, got {} of shape {}", op, name, rank,
                 rank == 1 ? "" : "s", t.dim(), shape_str(t.shape()));
}

void check_shape(std::string_view op, std::string_view name, const TensorView& t,
                 const Shape& expected) {
  MESHFUSE_CHECK(t.shape() == expected, ErrorCode::ShapeMismatch,
                 "{}: '{}' must have shape {}, got {}", op, name, shape_str(expected),
                 shape_str(t.shape()));
}

void check_output(std::string_view op, std::string_view name, const TensorView& t,
                  const Shape& expected, DType dtype) {
  check_defined(op, name, t);
  check_shape(op, name, t, expected);
  MESHFUSE_CHECK(t.dtype() == dtype, ErrorCode::DTypeMismatch, "{}: output '{}' must be {}, got {}",
                 op, name, to_string(dtype), to_string(t.dtype()));
  MESHFUSE_CHECK(t.is_contiguous(), ErrorCode::InvalidArgument,
                 "{}: output '{}' must be contiguous, got {}", op, name, t.str());
}

KernelCall::KernelCall(std::string_view op, std::initializer_list<NamedTensor> tensors,
                       std::initializer_list<InPlace> in_place, KernelBackend backend,
                       Device device, const Stream& stream)
    : op_(op),
      tensors_(tensors),
      in_place_(in_place),
      host_(backend == KernelBackend::Reference && device.type == DeviceType::CUDA),
      stream_(stream) {
  MESHFUSE_CHECK(stream.device == device, ErrorCode::DeviceMismatch,
                 "{}: the stream is on {} but the tensors are on {} (pass a stream of {}: "
                 "Stream{{device}} is its default stream)",
                 op, stream.device.str(), device.str(), device.str());
  // A CUDA stream's handle passed with CPU tensors (Python's stream=) was ignored silently.
  MESHFUSE_CHECK(device.type != DeviceType::CPU || stream.native == nullptr,
                 ErrorCode::InvalidArgument,
                 "{}: stream: a native stream handle ({}) came with tensors on the CPU, where ops "
                 "run on the calling thread: pass none",
                 op, stream.native);
}

TensorView KernelCall::input(const TensorView& t) {
  if (!host_ && t.defined() && !t.is_contiguous())
    return copies_.emplace_back(Tensor::copy_of(t, stream_)).view();
  return strided_input(t);
}

TensorView KernelCall::strided_input(const TensorView& t) {
  if (!host_ || !t.defined()) return t;
  Tensor& host = copies_.emplace_back(t.shape(), t.dtype());
  copy(t, host, stream_);
  return host.view();
}

namespace {

// The bytes [first, last) from t's lowest to past its highest element (t not empty): exactly its
// elements when contiguous, a bound of them otherwise.
std::pair<std::uintptr_t, std::uintptr_t> byte_span(const TensorView& t) {
  const auto e = static_cast<std::int64_t>(element_size(t.dtype()));
  std::int64_t lo = 0, hi = 0;
  for (std::int64_t d = 0; d < t.dim(); ++d) {
    const std::int64_t reach = (t.shape()[d] - 1) * t.strides()[d];
    (reach < 0 ? lo : hi) += reach;
  }
  const auto base = reinterpret_cast<std::uintptr_t>(t.data());
  return {base + static_cast<std::uintptr_t>(lo * e),
          base + static_cast<std::uintptr_t>((hi + 1) * e)};
}

}  // namespace

void KernelCall::check_overlap(const TensorView& out) const {
  if (!out.defined() || out.numel() == 0) return;
  // The arguments that are `out` itself: several when one view object was passed for several;
  // the last is the output (run_kernel's lists give outputs after inputs).
  std::vector<std::string_view> selves;
  for (const NamedTensor& n : tensors_)
    if (&n.tensor == &out) selves.push_back(n.name);
  const std::string_view name = selves.empty() ? "output" : selves.back();
  const auto in_place = [&](std::string_view a, std::string_view b) {
    return std::any_of(in_place_.begin(), in_place_.end(), [&](const InPlace& p) {
      return (p.output == a && p.input == b) || (p.output == b && p.input == a);
    });
  };
  const auto check_same = [&](std::string_view output, std::string_view input) {
    if (in_place(output, input)) return;
    std::string where;
    for (const InPlace& p : in_place_)
      where += fmt::format("{}'{}' over '{}'", where.empty() ? "" : ", ", p.output, p.input);
    fail(ErrorCode::InvalidArgument,
         "{}: output '{}' ({}) is the same memory as '{}'; {} writes in place only {}: pass "
         "separate memory",
         op_, output, out.str(), input, op_, where.empty() ? "nowhere" : where);
  };
  for (std::size_t i = 0; i + 1 < selves.size(); ++i) check_same(name, selves[i]);
  const auto [first, last] = byte_span(out);
  for (const NamedTensor& n : tensors_) {
    const TensorView& t = n.tensor;
    if (&t == &out || !t.defined() || t.numel() == 0 || t.device() != out.device()) continue;
    if (t.data() == out.data() && t.shape() == out.shape() && t.strides() == out.strides()) {
      check_same(name, n.name);  // the very same elements: in place where the op allows it
      continue;
    }
    const auto [f, l] = byte_span(t);
    MESHFUSE_CHECK(l <= first || last <= f, ErrorCode::InvalidArgument,
                   "{}: output '{}' ({}) overlaps '{}' ({}) without being the same view; write "
                   "in place into that tensor itself where the op allows it, or into separate "
                   "memory",
                   op_, name, out.str(), n.name, t.str());
  }
}

TensorView KernelCall::output(const TensorView& t) {
  check_overlap(t);
  if (!host_ || !t.defined()) return t;
  Tensor host(t.shape(), t.dtype());
  copy(t, host, stream_);
  outputs_.emplace_back(host, t);
  return host.view();
}

void KernelCall::finish() {
  for (const auto& [host, device] : outputs_) copy(host, device, stream_);
  if (host_) synchronize(stream_);
  outputs_.clear();
}

std::int64_t leading_rows(const TensorView& t) {
  std::int64_t rows = 1;
  for (std::int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.shape()[d];
  return rows;
}

}  // namespace meshfuse::detail
