// RNN / GRU front-end: argument checks, head broadcasting, cu_seqlens checked on the host, backend
// dispatch.
#include "meshfuse/ops/recurrent.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops/common.h"
#include "ops/recurrent/recurrent_kernels.h"

namespace meshfuse {
namespace {

using detail::RecurrentShape;

const auto kRnn = MESHFUSE_KERNEL_TABLE("rnn", detail::kFloatDTypes, rnn_forward);
const auto kRnnBackward = MESHFUSE_KERNEL_TABLE("rnn_backward", detail::kFloatDTypes, rnn_backward);
const auto kGru = MESHFUSE_KERNEL_TABLE("gru", detail::kFloatDTypes, gru_forward);
const auto kGruBackward = MESHFUSE_KERNEL_TABLE("gru_backward", detail::kFloatDTypes, gru_backward);

// The GRU's tensors in RecurrentShape's order (candidate, forget, reset), with their names.
constexpr std::string_view kGruInputNames[3] = {"input", "forget_input", "reset_input"};
constexpr std::string_view kGruWeightNames[3] = {"weight", "forget_weight", "reset_weight"};
constexpr std::string_view kGradInputNames[3] = {"grad_input", "grad_forget_input",
                                                 "grad_reset_input"};
constexpr std::string_view kGradWeightNames[3] = {"grad_weight", "grad_forget_weight",
                                                  "grad_reset_weight"};
const TensorView* gru_inputs(const GruParams& p, int k) {
  const TensorView* t[3] = {&p.input, &p.forget_input, &p.reset_input};
  return t[k];
}
const TensorView* gru_weights(const GruParams& p, int k) {
  const TensorView* t[3] = {&p.weight, &p.forget_weight, &p.reset_weight};
  return t[k];
}

// The token rows of a call, read from the tensor that defines them (the forward's input, the
// backward's output): padded (B, S, heads, H) or packed (T, heads, H) with cu_seqlens.
struct Rows {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;  // S, or the longest packed sequence
  Shape lead;                // (B, S) or (T,)
  std::int64_t head_dim = 0;
  TensorView offsets;  // i64 (B+1,) contiguous on the tensors' device (packed only)
  Tensor offsets_copy;
};

Rows read_rows(std::string_view op, std::string_view name, const TensorView& t,
               const TensorView& cu_seqlens, std::int64_t max_seqlen, const Stream& stream) {
  Rows rows;
  if (!cu_seqlens.defined()) {
    MESHFUSE_CHECK(t.dim() == 4, ErrorCode::InvalidArgument,
                   "{}: '{}' must have 4 dimensions (B, S, heads, H) without cu_seqlens, got "
                   "shape {}",
                   op, name, shape_str(t.shape()));
    MESHFUSE_CHECK(max_seqlen == -1, ErrorCode::InvalidArgument,
                   "{}: max_seqlen is for packed input (with cu_seqlens), got {} without "
                   "cu_seqlens",
                   op, max_seqlen);
    rows.batch = t.size(0);
    rows.seq_len = t.size(1);
    rows.lead = {t.size(0), t.size(1)};
    rows.head_dim = t.size(3);
    return rows;
  }
  detail::check_dtype(op, "cu_seqlens", cu_seqlens, {DType::I32, DType::U32, DType::I64});
  detail::check_rank(op, "cu_seqlens", cu_seqlens, 1);
  MESHFUSE_CHECK(cu_seqlens.size(0) >= 1, ErrorCode::InvalidArgument,
                 "{}: 'cu_seqlens' must hold B+1 offsets (at least one), got an empty tensor", op);
  MESHFUSE_CHECK(t.dim() == 3, ErrorCode::InvalidArgument,
                 "{}: '{}' must have 3 dimensions (T, heads, H) with cu_seqlens, got shape {}", op,
                 name, shape_str(t.shape()));
  MESHFUSE_CHECK(max_seqlen >= -1, ErrorCode::InvalidArgument,
                 "{}: max_seqlen must be -1 (unknown) or >= 0, got {}", op, max_seqlen);
  const std::int64_t tokens = t.size(0);
  rows.batch = cu_seqlens.size(0) - 1;
  rows.lead = {tokens};
  rows.head_dim = t.size(2);

  // The offsets are read on the host (a small device-to-host copy when they live on a GPU).
  Tensor host({cu_seqlens.size(0)}, DType::I64);
  copy(cu_seqlens, host, stream);
  const std::int64_t* cu = host.data_ptr<std::int64_t>();
  MESHFUSE_CHECK(cu[0] == 0, ErrorCode::InvalidArgument,
                 "{}: cu_seqlens must start at 0, got cu_seqlens[0] = {}", op, cu[0]);
  for (std::int64_t b = 0; b < rows.batch; ++b) {
    MESHFUSE_CHECK(cu[b + 1] >= cu[b], ErrorCode::InvalidArgument,
                   "{}: cu_seqlens must be non-decreasing, got cu_seqlens[{}] = {} < "
                   "cu_seqlens[{}] = {}",
                   op, b + 1, cu[b + 1], b, cu[b]);
    rows.seq_len = std::max(rows.seq_len, cu[b + 1] - cu[b]);
  }
  MESHFUSE_CHECK(cu[rows.batch] == tokens, ErrorCode::InvalidArgument,
                 "{}: cu_seqlens must end at the number of rows T = {} of '{}', got "
                 "cu_seqlens[{}] = {}",
                 op, tokens, name, rows.batch, cu[rows.batch]);
  MESHFUSE_CHECK(max_seqlen == -1 || max_seqlen >= rows.seq_len, ErrorCode::InvalidArgument,
                 "{}: max_seqlen = {} is smaller than the longest sequence ({} rows)", op,
                 max_seqlen, rows.seq_len);

  if (cu_seqlens.dtype() == DType::I64 && cu_seqlens.is_contiguous()) {
    rows.offsets = cu_seqlens;
  } else {
    rows.offsets_copy = Tensor({cu_seqlens.size(0)}, DType::I64, cu_seqlens.device(), stream);
    copy(cu_seqlens, rows.offsets_copy, stream);
    rows.offsets = rows.offsets_copy.view();
  }
  return rows;
}

// Checks a tensor of token rows, `rows.lead` x (heads, H); returns its head count.
std::int64_t check_token_tensor(std::string_view op, std::string_view name, const TensorView& t,
                                const Rows& rows) {
  const auto rank = static_cast<std::int64_t>(rows.lead.size()) + 2;
  Shape expected = rows.lead;
  expected.push_back(t.dim() == rank ? t.size(-2) : 1);
  expected.push_back(rows.head_dim);
  std::string lead;
  for (std::int64_t d : rows.lead) lead += fmt::format("{}, ", d);
  MESHFUSE_CHECK(t.dim() == rank && t.shape() == expected, ErrorCode::ShapeMismatch,
                 "{}: '{}' must have shape [{}heads, {}], got {}", op, name, lead, rows.head_dim,
                 shape_str(t.shape()));
  return t.size(-2);
}

// Checks a weight (heads, H, H); returns its head count.
std::int64_t check_weight(std::string_view op, std::string_view name, const TensorView& w,
                          const Rows& rows) {
  const std::int64_t h = rows.head_dim;
  MESHFUSE_CHECK(w.dim() == 3 && w.size(1) == h && w.size(2) == h, ErrorCode::ShapeMismatch,
                 "{}: '{}' must have shape [heads, {}, {}], got {}", op, name, h, h,
                 shape_str(w.shape()));
  return w.size(0);
}

struct HeadCount {
  std::string_view name;
  std::int64_t count;
};

// N: the largest head count; each count must divide it.
std::int64_t common_heads(std::string_view op, const std::vector<HeadCount>& counts) {
  std::int64_t n = 0;
  for (const HeadCount& c : counts) {
    MESHFUSE_CHECK(c.count >= 1, ErrorCode::ShapeMismatch,
                   "{}: '{}' must have at least one head, got 0", op, c.name);
    n = std::max(n, c.count);
  }
  for (const HeadCount& c : counts)
    MESHFUSE_CHECK(n % c.count == 0, ErrorCode::ShapeMismatch,
                   "{}: the head count of '{}' ({}) must divide the number of heads N = {} (the "
                   "largest head count among the inputs, weights and input_state)",
                   op, c.name, c.count, n);
  return n;
}

// input_state's head count joins `counts` when it is given (of the dtype of `like`, rank 3).
void add_state_heads(std::string_view op, const TensorView& input_state, const TensorView& like,
                     std::string_view like_name, std::vector<HeadCount>& counts) {
  if (!input_state.defined()) return;
  detail::check_same_dtype(op, "input_state", input_state, like.dtype(), like_name);
  detail::check_rank(op, "input_state", input_state, 3);
  counts.push_back({"input_state", input_state.size(1)});
}

Shape state_shape(const Rows& rows, std::int64_t heads) {
  return {rows.batch, heads, rows.head_dim};
}

Shape token_shape(const Rows& rows, std::int64_t heads) {
  Shape s = rows.lead;
  s.push_back(heads);
  s.push_back(rows.head_dim);
  return s;
}

double clipping_bound(std::string_view op, std::optional<double> gradient_clipping) {
  if (!gradient_clipping) return INFINITY;
  MESHFUSE_CHECK(*gradient_clipping >= 0, ErrorCode::InvalidArgument,
                 "{}: gradient_clipping must be >= 0 (or not given), got {}", op,
                 *gradient_clipping);
  return *gradient_clipping;
}

// The backward's upstream gradients and input_state: optional, each like its forward tensor.
void check_optional(std::string_view op, std::string_view name, const TensorView& t,
                    const TensorView& like, std::string_view like_name, const Shape& shape) {
  if (!t.defined()) return;
  detail::check_same_dtype(op, name, t, like.dtype(), like_name);
  detail::check_shape(op, name, t, shape);
}

void check_grad_input_state(std::string_view op, const TensorView& grad_input_state,
                            const TensorView& input_state, const TensorView& output) {
  if (!grad_input_state.defined()) return;
  MESHFUSE_CHECK(input_state.defined(), ErrorCode::InvalidArgument,
                 "{}: 'grad_input_state' is given but 'input_state' is not", op);
  detail::check_output(op, "grad_input_state", grad_input_state, input_state.shape(),
                       output.dtype());
}

// The token rows of a call and its heads: the head counts of its (input, weight) pairs (the
// inputs', then the weights'), and N, the largest of them and of input_state's.
struct Layout {
  Rows rows;
  std::vector<HeadCount> counts;
  std::int64_t heads = 0;
};

// Reads the rows from `from` (named `from_name`; input_state must have its dtype) and checks the
// pairs through pair_heads(rows), which returns their head counts.
template <typename PairHeads>
Layout read_layout(std::string_view op, std::string_view from_name, const TensorView& from,
                   const TensorView& input_state, const TensorView& cu_seqlens,
                   std::int64_t max_seqlen, const Stream& stream, PairHeads&& pair_heads) {
  Layout l{read_rows(op, from_name, from, cu_seqlens, max_seqlen, stream), {}, 0};
  l.counts = pair_heads(l.rows);
  std::vector<HeadCount> all = l.counts;
  add_state_heads(op, input_state, from, from_name, all);
  l.heads = common_heads(op, all);
  return l;
}

// The forward's input_state and outputs, of the layout's shapes.
void check_forward_states(std::string_view op, const TensorView& input,
                          const TensorView& input_state, const TensorView& output,
                          const TensorView& final_state, const Layout& l) {
  check_optional(op, "input_state", input_state, input, "input", state_shape(l.rows, l.heads));
  detail::check_output(op, "output", output, token_shape(l.rows, l.heads), input.dtype());
  if (final_state.defined())
    detail::check_output(op, "final_state", final_state, state_shape(l.rows, l.heads),
                         input.dtype());
}

// The backward's output and its optional tensors of the forward's shapes: input_state and the
// upstream gradients.
void check_backward_states(std::string_view op, const TensorView& output,
                           const TensorView& input_state, const TensorView& grad_output,
                           const TensorView& grad_final_state, const Layout& l) {
  detail::check_shape(op, "output", output, token_shape(l.rows, l.heads));
  check_optional(op, "input_state", input_state, output, "output", state_shape(l.rows, l.heads));
  check_optional(op, "grad_output", grad_output, output, "output", output.shape());
  check_optional(op, "grad_final_state", grad_final_state, output, "output",
                 state_shape(l.rows, l.heads));
}

RecurrentShape make_shape(DType dtype, const Layout& l, const TensorView& offsets) {
  RecurrentShape s{};
  s.dtype = dtype;
  s.batch = l.rows.batch;
  s.seq_len = l.rows.seq_len;
  s.heads = l.heads;
  s.head_dim = l.rows.head_dim;
  s.cu_seqlens = offsets.defined() ? offsets.data_ptr<const std::int64_t>() : nullptr;
  const std::size_t pairs = l.counts.size() / 2;
  for (std::size_t k = 0; k < 3; ++k) {
    s.input_heads[k] = k < pairs ? l.counts[k].count : l.heads;
    s.weight_heads[k] = k < pairs ? l.counts[pairs + k].count : l.heads;
  }
  return s;
}

}  // namespace

void rnn(const TensorView& input, const TensorView& weight, const TensorView& input_state,
         const TensorView& output, const TensorView& final_state, const TensorView& cu_seqlens,
         std::int64_t max_seqlen, const Stream& stream) {
  constexpr std::string_view op = "rnn";
  detail::check_float(op, "input", input);
  detail::check_dtype_of(op, "weight", weight, input, "input");
  detail::run_kernel(
      kRnn,
      {{"input", input},
       {"weight", weight},
       {"input_state", input_state},
       {"output", output},
       {"final_state", final_state},
       {"cu_seqlens", cu_seqlens}},
      stream, [&](auto* fn, detail::KernelCall& call) {
        const Layout l = read_layout(
            op, "input", input, input_state, cu_seqlens, max_seqlen, stream, [&](const Rows& rows) {
              return std::vector<HeadCount>{{"input", check_token_tensor(op, "input", input, rows)},
                                            {"weight", check_weight(op, "weight", weight, rows)}};
            });
        check_forward_states(op, input, input_state, output, final_state, l);
        const RecurrentShape s = make_shape(input.dtype(), l, call.input(l.rows.offsets));
        fn(s, call.input(input).data(), call.input(weight).data(), call.input(input_state).data(),
           call.output(output).data(), call.output(final_state).data(), call.stream());
      });
}

void rnn_backward(const TensorView& grad_output, const TensorView& grad_final_state,
                  const TensorView& output, const TensorView& weight, const TensorView& input_state,
                  const TensorView& grad_input, const TensorView& grad_weight,
                  const TensorView& grad_input_state, std::optional<double> gradient_clipping,
                  const TensorView& cu_seqlens, std::int64_t max_seqlen, const Stream& stream) {
  constexpr std::string_view op = "rnn_backward";
  detail::check_float(op, "output", output);
  detail::check_dtype_of(op, "weight", weight, output, "output");
  detail::check_dtype_of(op, "grad_input", grad_input, output, "output");
  const double clip = clipping_bound(op, gradient_clipping);
  detail::run_kernel(
      kRnnBackward,
      {{"output", output},
       {"grad_output", grad_output},
       {"grad_final_state", grad_final_state},
       {"weight", weight},
       {"input_state", input_state},
       {"grad_input", grad_input},
       {"grad_weight", grad_weight},
       {"grad_input_state", grad_input_state},
       {"cu_seqlens", cu_seqlens}},
      stream, [&](auto* fn, detail::KernelCall& call) {
        const Layout l = read_layout(
            op, "output", output, input_state, cu_seqlens, max_seqlen, stream,
            [&](const Rows& rows) {
              return std::vector<HeadCount>{
                  {"grad_input", check_token_tensor(op, "grad_input", grad_input, rows)},
                  {"weight", check_weight(op, "weight", weight, rows)}};
            });
        check_backward_states(op, output, input_state, grad_output, grad_final_state, l);
        detail::check_output(op, "grad_input", grad_input, grad_input.shape(), output.dtype());
        detail::check_output(op, "grad_weight", grad_weight, weight.shape(), output.dtype());
        check_grad_input_state(op, grad_input_state, input_state, output);

        const RecurrentShape s = make_shape(output.dtype(), l, call.input(l.rows.offsets));
        fn(s, call.input(grad_output).data(), call.input(grad_final_state).data(),
           call.input(output).data(), call.input(weight).data(), call.input(input_state).data(),
           call.output(grad_input).data(), call.output(grad_weight).data(),
           call.output(grad_input_state).data(), clip, call.stream());
      });
}

namespace {

// Checks the GRU's three (input, weight) pairs against the token rows; returns their head counts
// (inputs, then weights).
std::vector<HeadCount> check_gru_params(std::string_view op, const GruParams& p, const Rows& rows,
                                        const TensorView& like, std::string_view like_name) {
  for (int k = 0; k < 3; ++k) {
    detail::check_dtype_of(op, kGruInputNames[k], *gru_inputs(p, k), like, like_name);
    detail::check_dtype_of(op, kGruWeightNames[k], *gru_weights(p, k), like, like_name);
  }
  std::vector<HeadCount> counts;
  for (int k = 0; k < 3; ++k)
    counts.push_back(
        {kGruInputNames[k], check_token_tensor(op, kGruInputNames[k], *gru_inputs(p, k), rows)});
  for (int k = 0; k < 3; ++k)
    counts.push_back(
        {kGruWeightNames[k], check_weight(op, kGruWeightNames[k], *gru_weights(p, k), rows)});
  return counts;
}

// The GRU's inputs and weights as the kernel reads them.
detail::GruPointers gru_pointers(detail::KernelCall& call, const GruParams& p) {
  detail::GruPointers out{};
  for (int k = 0; k < 3; ++k) {
    out.input[k] = call.input(*gru_inputs(p, k)).data();
    out.weight[k] = call.input(*gru_weights(p, k)).data();
  }
  return out;
}

}  // namespace

void gru(const GruParams& params, const TensorView& input_state, const TensorView& output,
         const TensorView& final_state, const TensorView& cu_seqlens, std::int64_t max_seqlen,
         const Stream& stream) {
  constexpr std::string_view op = "gru";
  const TensorView& input = params.input;
  detail::check_float(op, "input", input);
  detail::run_kernel(
      kGru,
      {{"input", input},
       {"weight", params.weight},
       {"forget_input", params.forget_input},
       {"forget_weight", params.forget_weight},
       {"reset_input", params.reset_input},
       {"reset_weight", params.reset_weight},
       {"input_state", input_state},
       {"output", output},
       {"final_state", final_state},
       {"cu_seqlens", cu_seqlens}},
      stream, [&](auto* fn, detail::KernelCall& call) {
        const Layout l = read_layout(
            op, "input", input, input_state, cu_seqlens, max_seqlen, stream,
            [&](const Rows& rows) { return check_gru_params(op, params, rows, input, "input"); });
        check_forward_states(op, input, input_state, output, final_state, l);
        const RecurrentShape s = make_shape(input.dtype(), l, call.input(l.rows.offsets));
        fn(s, gru_pointers(call, params), call.input(input_state).data(),
           call.output(output).data(), call.output(final_state).data(), call.stream());
      });
}

void gru_backward(const TensorView& grad_output, const TensorView& grad_final_state,
                  const TensorView& output, const GruParams& params, const TensorView& input_state,
                  const GruParams& grads, const TensorView& grad_input_state,
                  std::optional<double> gradient_clipping, const TensorView& cu_seqlens,
                  std::int64_t max_seqlen, const Stream& stream) {
  constexpr std::string_view op = "gru_backward";
  detail::check_float(op, "output", output);
  const double clip = clipping_bound(op, gradient_clipping);
  detail::run_kernel(
      kGruBackward,
      {{"output", output},
       {"grad_output", grad_output},
       {"grad_final_state", grad_final_state},
       {"input_state", input_state},
       {"grad_input_state", grad_input_state},
       {"cu_seqlens", cu_seqlens},
       {"input", params.input},
       {"weight", params.weight},
       {"grad_input", grads.input},
       {"grad_weight", grads.weight},
       {"forget_input", params.forget_input},
       {"forget_weight", params.forget_weight},
       {"grad_forget_input", grads.forget_input},
       {"grad_forget_weight", grads.forget_weight},
       {"reset_input", params.reset_input},
       {"reset_weight", params.reset_weight},
       {"grad_reset_input", grads.reset_input},
       {"grad_reset_weight", grads.reset_weight}},
      stream, [&](auto* fn, detail::KernelCall& call) {
        const Layout l = read_layout(
            op, "output", output, input_state, cu_seqlens, max_seqlen, stream,
            [&](const Rows& rows) { return check_gru_params(op, params, rows, output, "output"); });
        check_backward_states(op, output, input_state, grad_output, grad_final_state, l);
        for (int k = 0; k < 3; ++k) {
          detail::check_output(op, kGradInputNames[k], *gru_inputs(grads, k),
                               gru_inputs(params, k)->shape(), output.dtype());
          detail::check_output(op, kGradWeightNames[k], *gru_weights(grads, k),
                               gru_weights(params, k)->shape(), output.dtype());
        }
        check_grad_input_state(op, grad_input_state, input_state, output);

        detail::GruGradPointers g{};
        for (int k = 0; k < 3; ++k) {
          g.input[k] = call.output(*gru_inputs(grads, k)).data();
          g.weight[k] = call.output(*gru_weights(grads, k)).data();
        }
        const RecurrentShape s = make_shape(output.dtype(), l, call.input(l.rows.offsets));
        fn(s, call.input(grad_output).data(), call.input(grad_final_state).data(),
           call.input(output).data(), gru_pointers(call, params), call.input(input_state).data(), g,
           call.output(grad_input_state).data(), clip, call.stream());
      });
}

}  // namespace meshfuse
