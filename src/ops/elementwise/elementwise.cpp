// Elementwise front-end: argument checks, the aliasing rule, the merged layout, backend dispatch.
#include "meshfuse/ops/elementwise.h"

#include <array>
#include <cstdint>
#include <vector>

#include "ops/common.h"
#include "ops/elementwise/elementwise_kernels.h"

namespace meshfuse {
namespace detail {

std::optional<ElementwiseLayout> elementwise_layout(std::span<const TensorView> inputs) {
  ElementwiseLayout l{};
  const TensorView& first = inputs.front();
  l.shape.dtype = first.dtype();
  l.shape.numel = first.numel();
  // Kept dimensions from the innermost out: sizes[j] and each input's stride of it.
  std::vector<std::int64_t> sizes;
  std::vector<std::array<std::int64_t, 2>> strides;
  if (l.shape.numel > 0) {
    for (std::int64_t d = first.dim() - 1; d >= 0; --d) {
      const std::int64_t n = first.shape()[d];
      if (n == 1) continue;  // its stride never multiplies a nonzero index
      bool merges = !sizes.empty();
      for (std::size_t k = 0; k < inputs.size() && merges; ++k)
        merges = inputs[k].strides()[d] == strides.back()[k] * sizes.back();
      if (merges) {
        sizes.back() *= n;
        continue;
      }
      sizes.push_back(n);
      strides.push_back({});
      for (std::size_t k = 0; k < inputs.size(); ++k) strides.back()[k] = inputs[k].strides()[d];
    }
  }
  if (sizes.empty()) {  // one element (or none): a single dimension of unit stride
    sizes.push_back(l.shape.numel);
    strides.push_back({1, 1});
  }
  if (sizes.size() > static_cast<std::size_t>(kElementwiseMaxDims)) return std::nullopt;
  l.shape.dims = static_cast<int>(sizes.size());
  for (int j = 0; j < l.shape.dims; ++j) l.shape.sizes[l.shape.dims - 1 - j] = sizes[j];
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    ElementwiseInput& in = l.inputs[k];
    in.data = inputs[k].data();
    in.linear = true;
    std::int64_t row_major = 1;
    for (int j = 0; j < l.shape.dims; ++j) {
      in.strides[l.shape.dims - 1 - j] = strides[j][k];
      in.linear = in.linear && strides[j][k] == row_major;
      row_major *= sizes[j];
    }
  }
  return l;
}

}  // namespace detail

namespace {

using detail::ElementwiseLayout;

const auto kAdd = MESHFUSE_KERNEL_TABLE("add", detail::kFloatDTypes, elementwise_add);
const auto kMul = MESHFUSE_KERNEL_TABLE("mul", detail::kFloatDTypes, elementwise_mul);

// The layout of the staged inputs; inputs needing more dimensions than the kernels index are
// copied contiguous first (a rare case: merging leaves one or two dimensions for usual views).
template <std::size_t K>
ElementwiseLayout layout_of(detail::KernelCall& call, const std::array<TensorView, K>& inputs) {
  std::array<TensorView, K> staged;
  for (std::size_t k = 0; k < K; ++k) staged[k] = call.strided_input(inputs[k]);
  if (auto l = detail::elementwise_layout(staged)) return *l;
  for (std::size_t k = 0; k < K; ++k) staged[k] = call.input(inputs[k]);
  return *detail::elementwise_layout(staged);
}

}  // namespace

void add(const TensorView& a, const TensorView& b, const TensorView& out, double alpha,
         const Stream& stream) {
  constexpr std::string_view op = "add";
  detail::check_float(op, "a", a);
  detail::check_like(op, "b", b, a, "a");
  detail::check_output(op, "out", out, a.shape(), a.dtype());
  detail::run_kernel(kAdd, {{"a", a}, {"b", b}, {"out", out}}, {{"out", "a"}, {"out", "b"}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       const ElementwiseLayout l = layout_of<2>(call, {a, b});
                       fn(l.shape, l.inputs[0], l.inputs[1], call.output(out).data(), alpha,
                          call.stream());
                     });
}

void mul(const TensorView& a, double scalar, const TensorView& out, const Stream& stream) {
  constexpr std::string_view op = "mul";
  detail::check_float(op, "a", a);
  detail::check_output(op, "out", out, a.shape(), a.dtype());
  detail::run_kernel(kMul, {{"a", a}, {"out", out}}, {{"out", "a"}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       const ElementwiseLayout l = layout_of<1>(call, {a});
                       fn(l.shape, l.inputs[0], call.output(out).data(), scalar, call.stream());
                     });
}

}  // namespace meshfuse
