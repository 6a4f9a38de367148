// pack_sequence / unpack_sequence front-end: shape and cu_seqlens checks, backend dispatch.
#include "meshfuse/ops/pack_sequence.h"

#include "ops/common.h"
#include "ops/pack_sequence/pack_sequence_kernels.h"

namespace meshfuse {
namespace {

// A copy moves any element type.
const std::vector<DType> kAllDTypes = {DType::F32, DType::F64, DType::F16, DType::BF16,
                                       DType::I32, DType::I64, DType::U8,  DType::U32, DType::Bool};

const auto kPack = MESHFUSE_KERNEL_TABLE("pack_sequence", kAllDTypes, pack_sequence);
const auto kUnpack = MESHFUSE_KERNEL_TABLE("unpack_sequence", kAllDTypes, unpack_sequence);

// `head` followed by the dims of t from dimension d on.
Shape with_trailing(Shape head, const TensorView& t, std::int64_t d) {
  head.insert(head.end(), t.shape().begin() + d, t.shape().end());
  return head;
}

void check_cu_seqlens_tensor(std::string_view op, const TensorView& cu, std::int64_t batch) {
  detail::check_defined(op, "cu_seqlens", cu);
  detail::check_dtype(op, "cu_seqlens", cu, {DType::I32, DType::U32, DType::I64});
  detail::check_shape(op, "cu_seqlens", cu, {batch + 1});
}

// Reads the offsets on the host (waiting for `stream` when cu is on a GPU) and checks them:
// 0 first, non-decreasing, T last, no sequence longer than S.
void check_offsets(std::string_view op, const TensorView& cu, std::int64_t batch,
                   std::int64_t seq_len, std::int64_t tokens, std::string_view tokens_from,
                   const Stream& stream) {
  Tensor host({batch + 1}, DType::I64);
  copy(cu, host, stream);
  const std::int64_t* c = host.data_ptr<std::int64_t>();
  MESHFUSE_CHECK(c[0] == 0, ErrorCode::InvalidArgument, "{}: cu_seqlens[0] must be 0, got {}", op,
                 c[0]);
  for (std::int64_t b = 0; b < batch; ++b) {
    MESHFUSE_CHECK(c[b + 1] >= c[b], ErrorCode::InvalidArgument,
                   "{}: cu_seqlens must be non-decreasing, got cu_seqlens[{}] = {} after "
                   "cu_seqlens[{}] = {}",
                   op, b + 1, c[b + 1], b, c[b]);
    MESHFUSE_CHECK(c[b + 1] - c[b] <= seq_len, ErrorCode::InvalidArgument,
                   "{}: sequence {} has {} tokens (cu_seqlens[{}] - cu_seqlens[{}]), more than "
                   "the padded length S = {}",
                   op, b, c[b + 1] - c[b], b + 1, b, seq_len);
  }
  MESHFUSE_CHECK(c[batch] == tokens, ErrorCode::InvalidArgument,
                 "{}: cu_seqlens[{}] (the last) must equal T = {}, the rows of '{}', got {}", op,
                 batch, tokens, tokens_from, c[batch]);
}

// Selects the kernel, checks the offsets, then runs it. padded: the (B, S, ...) tensor.
void run(std::string_view op, const KernelTable<detail::PackFn>& table, const TensorView& x,
         const TensorView& cu_seqlens, const TensorView& out, const TensorView& padded,
         std::int64_t tokens, std::string_view tokens_from, PaddingSide side,
         const Stream& stream) {
  detail::run_kernel(table, {{"x", x}, {"cu_seqlens", cu_seqlens}, {"out", out}}, stream,
                     [&](auto* fn, detail::KernelCall& call) {
                       const TensorView cu = call.input(cu_seqlens);
                       const std::int64_t batch = padded.size(0), seq_len = padded.size(1);
                       check_offsets(op, cu, batch, seq_len, tokens, tokens_from, call.stream());
                       const std::int64_t row_bytes =
                           shape_numel(with_trailing({}, padded, 2)) *
                           static_cast<std::int64_t>(element_size(x.dtype()));
                       const detail::PackShape s{
                           batch, seq_len, tokens, row_bytes, side, cu.data(), cu_seqlens.dtype()};
                       fn(s, call.input(x).data(), call.output(out).data(), call.stream());
                     });
}

}  // namespace

void pack_sequence(const TensorView& x, const TensorView& cu_seqlens, const TensorView& out,
                   PaddingSide padding_side, const Stream& stream) {
  constexpr std::string_view op = "pack_sequence";
  detail::check_defined(op, "x", x);
  MESHFUSE_CHECK(x.dim() >= 2, ErrorCode::InvalidArgument,
                 "{}: 'x' must be (B, S, ...) with at least 2 dimensions, got shape {}", op,
                 shape_str(x.shape()));
  check_cu_seqlens_tensor(op, cu_seqlens, x.size(0));
  detail::check_defined(op, "out", out);
  const std::int64_t tokens = out.dim() >= 1 ? out.size(0) : 0;
  detail::check_output(op, "out", out, with_trailing({tokens}, x, 2), x.dtype());
  run(op, kPack, x, cu_seqlens, out, x, tokens, "out", padding_side, stream);
}

void unpack_sequence(const TensorView& x, const TensorView& cu_seqlens, const TensorView& out,
                     PaddingSide padding_side, const Stream& stream) {
  constexpr std::string_view op = "unpack_sequence";
  detail::check_defined(op, "x", x);
  MESHFUSE_CHECK(x.dim() >= 1, ErrorCode::InvalidArgument,
                 "{}: 'x' must be (T, ...) with at least 1 dimension, got a 0-d tensor", op);
  detail::check_defined(op, "out", out);
  MESHFUSE_CHECK(out.dim() == x.dim() + 1, ErrorCode::ShapeMismatch,
                 "{}: 'out' must be (B, S, ...) with the trailing dims of 'x' {}, got shape {}", op,
                 shape_str(with_trailing({}, x, 1)), shape_str(out.shape()));
  detail::check_output(op, "out", out, with_trailing({out.size(0), out.size(1)}, x, 1), x.dtype());
  check_cu_seqlens_tensor(op, cu_seqlens, out.size(0));
  run(op, kUnpack, x, cu_seqlens, out, out, x.size(0), "x", padding_side, stream);
}

}  // namespace meshfuse
