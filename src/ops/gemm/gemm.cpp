// GEMM front-end: argument checks, BLAS views of the operands, backend dispatch.
#include "meshfuse/ops/gemm.h"

#include <algorithm>
#include <optional>

#include "ops/common.h"
#include "ops/gemm/cpu_blas.h"
#include "ops/gemm/gemm_kernels.h"

namespace meshfuse {
namespace {

using detail::GemmMatrix;
using detail::GemmProblem;

const auto kGemm = MESHFUSE_KERNEL_TABLE("gemm", detail::kFloatDTypes, gemm);
const auto kBmm = MESHFUSE_KERNEL_TABLE("bmm", detail::kFloatDTypes, gemm);
const auto kLinear = MESHFUSE_KERNEL_TABLE("linear", detail::kFloatDTypes, gemm);
const auto kLinearBackward =
    MESHFUSE_KERNEL_TABLE("linear_backward", detail::kFloatDTypes, linear_backward);

// The BLAS view of a (rows, cols) matrix with strides (rs, cs): row-major when the columns have
// unit stride, transposed storage when the rows do; nullopt otherwise. A dim of size <= 1 takes
// any stride, and ld is at least the stored row length, as BLAS and oneDNN require.
std::optional<GemmMatrix> blas_view(void* data, std::int64_t rows, std::int64_t cols,
                                    std::int64_t rs, std::int64_t cs) {
  if ((cols <= 1 || cs == 1) && (rows <= 1 || rs >= cols))
    return GemmMatrix{data,
                      rows <= 1 ? std::max<std::int64_t>(cols, 1) : std::max<std::int64_t>(rs, 1),
                      0, false};
  if ((rows <= 1 || rs == 1) && (cols <= 1 || cs >= rows))
    return GemmMatrix{
        data, cols <= 1 ? std::max<std::int64_t>(rows, 1) : std::max<std::int64_t>(cs, 1), 0, true};
  return std::nullopt;
}

// One GEMM operand: the last two dims of a 2-D or 3-D tensor (3-D: a batch), transposed when
// op() says so. A view the BLAS can read (a transposed view included) is used in place; any other
// layout is copied once.
class Operand {
 public:
  Operand() = default;
  Operand(const TensorView& t, bool transpose, const Stream& stream) {
    if (!t.defined()) return;
    view(t);
    if (!matrix_) {
      copy_ = Tensor::copy_of(t, stream);
      view(copy_.view());
    }
    if (transpose) matrix_->transposed = !matrix_->transposed;
  }

  // t (..., cols) as one (rows, cols) matrix, rows being the product of the leading dims.
  static Operand rows_of(const TensorView& t, const Stream& stream) {
    if (t.dim() == 2) return Operand(t, false, stream);
    Operand o;
    o.copy_ = t.is_contiguous() ? Tensor() : Tensor::copy_of(t, stream);
    const TensorView& c = o.copy_.defined() ? o.copy_.view() : t;
    o.view(c.reshape({detail::leading_rows(t), t.size(-1)}));
    return o;
  }

  // A contiguous 1-D tensor (cols) broadcast to every row: ld = 0, which only C may use.
  static Operand broadcast_row(const TensorView& t) {
    Operand o;
    if (t.defined()) o.matrix_ = GemmMatrix{t.data(), 0, 0, false};
    return o;
  }

  GemmMatrix matrix() const { return matrix_.value_or(GemmMatrix{}); }

 private:
  void view(const TensorView& t) {
    matrix_ = blas_view(t.data(), t.size(-2), t.size(-1), t.stride(-2), t.stride(-1));
    if (matrix_ && t.dim() == 3) matrix_->batch_stride = t.stride(0);
  }

  Tensor copy_;
  std::optional<GemmMatrix> matrix_;
};

// A contiguous output of row length `cols`.
GemmMatrix output(const TensorView& t, std::int64_t cols, std::int64_t rows) {
  return {t.data(), std::max<std::int64_t>(cols, 1), rows * cols, false};
}

// The dtype of an output of a product of `like`'s dtype: that dtype or, for bf16 / f16 operands,
// f32 (the fp32 accumulation unrounded, as torch.mm's out_dtype).
DType output_dtype(std::string_view op, std::string_view name, const TensorView& out,
                   const TensorView& like, std::string_view like_name) {
  detail::check_defined(op, name, out);
  detail::check_same_or_f32(op, name, out, like.dtype(), like_name);
  return out.dtype();
}

GemmProblem problem(DType dtype, DType out, std::int64_t batch, std::int64_t m, std::int64_t n,
                    std::int64_t k, double alpha, double beta, std::string_view op) {
  return {dtype, batch,     m,
          n,     k,         alpha,
          beta,  op.data(), out != dtype ? std::optional<DType>(out) : std::nullopt};
}

// gemm (rank 2) and bmm (rank 3).
void matmul(std::string_view op, const KernelTable<detail::GemmFn>& table, std::int64_t rank,
            const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& d,
            const GemmOptions& o, const Stream& stream) {
  detail::check_float(op, "a", a);
  detail::check_dtype_of(op, "b", b, a, "a");
  detail::check_rank(op, "a", a, rank);
  detail::check_rank(op, "b", b, rank);
  const std::int64_t batch = rank == 3 ? a.size(0) : 1;
  MESHFUSE_CHECK(batch == (rank == 3 ? b.size(0) : 1), ErrorCode::ShapeMismatch,
                 "{}: 'a' {} and 'b' {} have different batch sizes", op, shape_str(a.shape()),
                 shape_str(b.shape()));
  const std::int64_t m = a.size(o.transpose_a ? -1 : -2), k = a.size(o.transpose_a ? -2 : -1);
  const std::int64_t kb = b.size(o.transpose_b ? -1 : -2), n = b.size(o.transpose_b ? -2 : -1);
  MESHFUSE_CHECK(k == kb, ErrorCode::ShapeMismatch,
                 "{}: op(a) and op(b) do not multiply: 'a' {} (transpose_a={}) has K = {}, 'b' {} "
                 "(transpose_b={}) has K = {}",
                 op, shape_str(a.shape()), o.transpose_a, k, shape_str(b.shape()), o.transpose_b,
                 kb);
  const Shape out_shape = rank == 3 ? Shape{batch, m, n} : Shape{m, n};
  const DType out = output_dtype(op, "d", d, a, "a");
  if (c.defined()) {
    detail::check_dtype_of(op, "c", c, d, "d");
    detail::check_shape(op, "c", c, out_shape);
  } else {
    MESHFUSE_CHECK(o.beta == 0, ErrorCode::InvalidArgument,
                   "{}: beta must be 0 when no 'c' is given, got beta = {}", op, o.beta);
  }
  detail::check_output(op, "d", d, out_shape, out);
  detail::run_kernel(table, {{"a", a}, {"b", b}, {"c", c}, {"d", d}}, {{"d", "c"}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       const Operand oa(call.strided_input(a), o.transpose_a, call.stream()),
                           ob(call.strided_input(b), o.transpose_b, call.stream()),
                           oc(call.strided_input(c), false, call.stream());
                       fn(problem(a.dtype(), out, batch, m, n, k, o.alpha, o.beta, op), oa.matrix(),
                          ob.matrix(), oc.matrix(), output(call.output(d), n, m), call.stream());
                     });
}

// The checks shared by linear and linear_backward; returns N.
std::int64_t check_linear(std::string_view op, const TensorView& x, const TensorView& weight) {
  detail::check_float(op, "x", x);
  MESHFUSE_CHECK(x.dim() >= 1, ErrorCode::InvalidArgument,
                 "{}: 'x' must have at least 1 dimension, got a 0-d tensor", op);
  detail::check_dtype_of(op, "weight", weight, x, "x");
  detail::check_rank(op, "weight", weight, 2);
  MESHFUSE_CHECK(weight.size(1) == x.size(-1), ErrorCode::ShapeMismatch,
                 "{}: 'weight' {} must be (N, {}) to match the last dim of 'x' {}", op,
                 shape_str(weight.shape()), x.size(-1), shape_str(x.shape()));
  return weight.size(0);
}

}  // namespace

void gemm(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& d,
          const GemmOptions& options, const Stream& stream) {
  matmul("gemm", kGemm, 2, a, b, c, d, options, stream);
}

void bmm(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& d,
         const GemmOptions& options, const Stream& stream) {
  matmul("bmm", kBmm, 3, a, b, c, d, options, stream);
}

void linear(const TensorView& x, const TensorView& weight, const TensorView& bias,
            const TensorView& out, const Stream& stream) {
  constexpr std::string_view op = "linear";
  const std::int64_t n = check_linear(op, x, weight);
  const DType out_dtype = output_dtype(op, "out", out, x, "x");
  if (bias.defined()) {
    MESHFUSE_CHECK(
        bias.dtype() == x.dtype() || bias.dtype() == out_dtype, ErrorCode::DTypeMismatch,
        "{}: 'bias' must have the dtype of 'x' ({}){}, got {}", op, to_string(x.dtype()),
        out_dtype != x.dtype() ? fmt::format(" or of 'out' ({})", to_string(out_dtype)) : "",
        to_string(bias.dtype()));
    detail::check_shape(op, "bias", bias, {n});
  }
  detail::check_output(op, "out", out, detail::with_last(x.shape(), n), out_dtype);
  const std::int64_t rows = detail::leading_rows(x), k = x.size(-1);
  detail::run_kernel(
      kLinear, {{"x", x}, {"weight", weight}, {"bias", bias}, {"out", out}}, stream,
      [&](auto* fn, detail::KernelCall& call) {
        const Operand ox = Operand::rows_of(call.strided_input(x), call.stream()),
                      ow(call.strided_input(weight), true, call.stream());
        // The bias is C, of the output's dtype: a 16-bit one is widened for an f32 output (N
        // elements; exact).
        const TensorView bias_in = call.input(bias);
        Tensor wide;
        if (bias.defined() && bias.dtype() != out_dtype) {
          wide = Tensor(bias_in.shape(), out_dtype, bias_in.device(), call.stream());
          copy(bias_in, wide, call.stream());
        }
        const Operand ob = Operand::broadcast_row(wide.defined() ? wide.view() : bias_in);
        fn(problem(x.dtype(), out_dtype, 1, rows, n, k, 1.0, bias.defined() ? 1.0 : 0.0, op),
           ox.matrix(), ow.matrix(), ob.matrix(), output(call.output(out), n, rows), call.stream());
      });
}

void linear_backward(const TensorView& grad_out, const TensorView& x, const TensorView& weight,
                     const TensorView& grad_x, const TensorView& grad_weight,
                     const TensorView& grad_bias, const Stream& stream) {
  constexpr std::string_view op = "linear_backward";
  const std::int64_t n = check_linear(op, x, weight);
  detail::check_dtype_of(op, "grad_out", grad_out, x, "x");
  detail::check_shape(op, "grad_out", grad_out, detail::with_last(x.shape(), n));
  if (grad_x.defined()) detail::check_output(op, "grad_x", grad_x, x.shape(), x.dtype());
  if (grad_weight.defined())
    detail::check_output(op, "grad_weight", grad_weight, weight.shape(), x.dtype());
  if (grad_bias.defined()) detail::check_output(op, "grad_bias", grad_bias, {n}, x.dtype());
  const std::int64_t rows = detail::leading_rows(x), k = x.size(-1);
  const DType dtype = x.dtype();
  detail::run_kernel(
      kLinearBackward,
      {{"grad_out", grad_out},
       {"x", x},
       {"weight", weight},
       {"grad_x", grad_x},
       {"grad_weight", grad_weight},
       {"grad_bias", grad_bias}},
      stream, [&](auto* kernels, detail::KernelCall& call) {
        const Operand dy = Operand::rows_of(call.strided_input(grad_out), call.stream());
        if (grad_x.defined()) {  // dx (rows, K) = dy (rows, N) @ W (N, K)
          const Operand ow(call.strided_input(weight), false, call.stream());
          kernels->gemm({dtype, 1, rows, k, n, 1.0, 0.0, op.data()}, dy.matrix(), ow.matrix(), {},
                        output(call.output(grad_x), k, rows), call.stream());
        }
        if (grad_weight.defined()) {  // dW (N, K) = dy^T (N, rows) @ x (rows, K)
          const Operand ox = Operand::rows_of(call.strided_input(x), call.stream());
          GemmMatrix dyt = dy.matrix();
          dyt.transposed = !dyt.transposed;
          kernels->gemm({dtype, 1, n, k, rows, 1.0, 0.0, op.data()}, dyt, ox.matrix(), {},
                        output(call.output(grad_weight), k, n), call.stream());
        }
        if (grad_bias.defined())
          kernels->column_sum(dtype, rows, n, dy.matrix(), call.output(grad_bias).data(),
                              call.stream());
      });
}

std::string cpu_blas_library() { return detail::cpu::cpu_blas_library(); }

std::string cublaslt_library() {
#ifdef MESHFUSE_WITH_CUDA
  return detail::cuda::cublaslt_library();
#else
  fail(ErrorCode::BackendUnavailable,
       "cublaslt_library: this build of meshfuse has no CUDA support (configure with "
       "-DMESHFUSE_CUDA=ON)");
#endif
}

}  // namespace meshfuse
