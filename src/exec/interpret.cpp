#include "exec/interpret.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "meshfuse/core/error.h"
#include "meshfuse/ops/cross_entropy.h"
#include "meshfuse/ops/elementwise.h"
#include "meshfuse/ops/fused_linear_cross_entropy.h"
#include "meshfuse/ops/gemm.h"
#include "meshfuse/ops/rmsnorm.h"
#include "meshfuse/ops/softmax.h"
#include "meshfuse/ops/swiglu.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"

namespace meshfuse::detail {

namespace {

// A per-row statistic (rstd, shaped as x's leading dims) as the kernels take it: (rows,); an
// undefined one (not computed) stays undefined.
TensorView flat(const TensorView& t) { return t.defined() ? t.reshape({t.numel()}) : t; }

// The optional result `i` (a weight's or bias's gradient when the op has that operand).
TensorView result(const std::vector<TensorView>& out, std::size_t i) {
  return i < out.size() ? out[i] : TensorView();
}

}  // namespace

void run_op(const ProgramOp& op, const std::vector<TensorView>& in,
            const std::vector<TensorView>& out, const Stream& stream) {
  switch (op.type) {
    case OpType::Linear:
      return linear(in[0], in[1], in[2], out[0], stream);
    case OpType::LinearBackward:
      return linear_backward(in[0], in[1], in[2], out[0], out[1], result(out, 2), stream);
    case OpType::Matmul:
      if (in[0].dim() == 2) return gemm(in[0], in[1], {}, out[0], {}, stream);
      return bmm(in[0], in[1], {}, out[0], {}, stream);
    case OpType::MatmulBackward: {
      // d(a b) = (g b^T, a^T g).
      const auto mm = in[0].dim() == 2 ? gemm : bmm;
      mm(in[0], in[2], {}, out[0], {.transpose_b = true}, stream);
      return mm(in[1], in[0], {}, out[1], {.transpose_a = true}, stream);
    }
    case OpType::Add:
      return add(in[0], in[1], out[0], 1.0, stream);
    case OpType::RmsNorm:
      return rmsnorm(in[0], in[1], out[0], flat(out[1]), op.eps, stream);
    case OpType::RmsNormBackward:
      return rmsnorm_backward(in[0], in[1], in[2], flat(in[3]), out[0], result(out, 1), stream);
    case OpType::FusedResidualAddRmsNorm:
      return fused_residual_add_rmsnorm(in[0], in[1], in[2], out[0], out[1], flat(out[2]), op.eps,
                                        op.multiplier, stream);
    case OpType::FusedResidualAddRmsNormBackward:
      return fused_residual_add_rmsnorm_backward(in[0], in[1], in[2], in[3], flat(in[4]), out[0],
                                                 out[1], result(out, 2), op.multiplier, stream);
    case OpType::Swiglu:
      return swiglu(in[0], in[1], out[0], stream);
    case OpType::SwigluBackward:
      return swiglu_backward(in[0], in[1], in[2], out[0], out[1], stream);
    case OpType::SwigluPacked:
      return swiglu_packed(in[0], op.layout, out[0], stream);
    case OpType::SwigluPackedBackward:
      return swiglu_packed_backward(in[0], in[1], op.layout, out[0], stream);
    case OpType::Softmax:
      return softmax(in[0], out[0], op.multiplier, stream);
    case OpType::SoftmaxBackward:
      return softmax_backward(in[0], in[1], out[0], op.multiplier, stream);
    case OpType::CrossEntropy:
      return cross_entropy(in[0], in[1], out[0], out[1], op.loss, stream);
    case OpType::CrossEntropyBackward:
      return cross_entropy_backward(in[0], in[1], in[2], in[3], out[0], op.loss, stream);
    case OpType::FusedLinearCrossEntropy:
      return fused_linear_cross_entropy(in[0], in[1], in[2], in[3], in[4], out[0], result(out, 1),
                                        result(out, 2), result(out, 3), op.loss,
                                        kFusedLinearCrossEntropyChunkRows, stream);
  }
  fail(ErrorCode::Internal, "run_op: op type {} has no kernel", static_cast<int>(op.type));
}

RowRoles row_roles(const ProgramOp& op) {
  const std::size_t n_in = op.inputs.size(), n_out = op.outputs.size();
  RowRoles r{true, std::vector<bool>(n_in), std::vector<bool>(n_out), std::vector<bool>(n_out)};
  const auto rows = [&](std::initializer_list<std::size_t> in, std::initializer_list<std::size_t> out,
                        std::initializer_list<std::size_t> summed = {}) {
    for (std::size_t i : in) r.row_inputs[i] = true;
    for (std::size_t j : out) r.row_outputs[j] = true;
    for (std::size_t j : summed)
      if (j < n_out) r.summed_outputs[j] = true;
    return r;
  };
  switch (op.type) {
    case OpType::Linear:
    case OpType::Matmul:  // a batch's dim 0 too: each matrix is its own
    case OpType::SwigluPacked:
    case OpType::Softmax:
      return rows({0}, {0});
    case OpType::Add:
    case OpType::Swiglu:
    case OpType::SwigluPackedBackward:
    case OpType::SoftmaxBackward:
      return rows({0, 1}, {0});
    case OpType::RmsNorm:
      return rows({0}, {0, 1});
    case OpType::FusedResidualAddRmsNorm:
      return rows({0, 1}, {0, 1, 2});
    case OpType::SwigluBackward:
      return rows({0, 1, 2}, {0, 1});
    case OpType::LinearBackward:  // (dy, x, w, b) -> (dx, dw[, db])
      return rows({0, 1}, {0}, {1, 2});
    default:
      break;
  }
  r.row_wise = false;
  return r;
}

namespace {

std::vector<double> as_doubles(const TensorView& t, const Stream& stream) {
  Tensor host(t.shape(), DType::F64);
  copy(t, host, stream);
  return {host.data_ptr<double>(), host.data_ptr<double>() + host.numel()};
}

// Copies host doubles into `t` (any device and floating dtype), rounding once.
void write(const std::vector<double>& values, const TensorView& t, const Stream& stream) {
  Tensor host(t.shape(), DType::F64);
  std::copy(values.begin(), values.end(), host.data_ptr<double>());
  copy(host, t, stream);
}

// The loss dtype the kernel computes per-row losses in: f32 for 16-bit logits.
DType row_loss_dtype(DType logits) { return is_sixteen_bit(logits) ? DType::F32 : logits; }

// Megatron-LM's vocabulary-parallel cross-entropy over rows [first, first + rows) of `labels`:
// this rank ran the kernel on its columns (cross_entropy.h, vocab_start / vocab_size: lse_s over
// them, loss_s with the label term only where the label is its own). Each rank sends per row its
// lse_s and its part of the loss, part_s = lse_s + z lse_s^2 - loss_s (its (1 - eps) v_y where the
// label is here, plus eps sum_j v_j / vocab_size); the ranks all-gather them, and every rank
// combines them in double in rank order, so that all agree bitwise:
//   lse_i  = log sum_s exp(lse_s,i)
//   loss_i = lse_i + z lse_i^2 - sum_s part_s,i
// (0 for ignored rows). Where a shard has no mass in a row (lse_s = -inf: no columns, or all of
// them -inf, as a padded vocabulary's masked columns) that difference is NaN, and part_s is what
// its definition gives: -inf where the label's logit or one in the smoothing sum is -inf (the row's
// loss +inf, as on one device; NaN for the label's at label smoothing 1, as there), else 0. The
// statistics are a few doubles per row: the host combines them.
struct Rows {
  std::vector<double> lse, loss;
};
Rows combine_shards(const TensorView& lse_s, const TensorView& loss_s, std::int64_t columns,
                    const std::vector<double>& labels, std::int64_t first,
                    const CrossEntropyOptions& o, Communicator& team, const Stream& stream) {
  const std::int64_t n = lse_s.numel();
  const int d = team.size();
  const double z = o.z_loss_scale, inf = std::numeric_limits<double>::infinity();
  // This rank's lse_s and loss_s come to the host in one copy; its lse_s and part_s go back in the
  // same buffer.
  const Device device = lse_s.device();
  const Tensor sent({2 * n}, DType::F64, device, stream);
  copy(lse_s, sent.view().narrow(0, 0, n), stream);
  copy(loss_s, sent.view().narrow(0, n, n), stream);
  std::vector<double> mine = as_doubles(sent, stream);  // lse_s, then loss_s -> part_s
  for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
    const double y = labels[static_cast<std::size_t>(first) + i], lse = mine[i];
    const bool here =
        y >= static_cast<double>(o.vocab_start) && y < static_cast<double>(o.vocab_start + columns);
    double& part = mine[static_cast<std::size_t>(n) + i];
    // Without mass: (1 - eps) v_y where the label is here (v_y = -inf; NaN at eps = 1, as on
    // one device), plus eps sum_j v_j / vocab_size where smoothing is on (-inf over -inf logits).
    part = lse != -inf ? lse + z * lse * lse - part
                       : (here ? (1 - o.label_smoothing) * -inf : 0.0) +
                             (o.label_smoothing > 0 && columns > 0 ? -inf : 0.0);
  }
  write(mine, sent, stream);
  const Tensor all({d * 2 * n}, DType::F64, device, stream);
  team.all_gather(sent, all, stream).keep_alive({sent, all}).wait();
  const std::vector<double> stats = as_doubles(all, stream);
  const auto at = [&](int s, std::int64_t offset) {
    return stats[static_cast<std::size_t>(s * 2 * n + offset)];
  };
  Rows rows{std::vector<double>(static_cast<std::size_t>(n)),
            std::vector<double>(static_cast<std::size_t>(n))};
  for (std::int64_t i = 0; i < n; ++i) {
    if (labels[static_cast<std::size_t>(first + i)] == static_cast<double>(o.ignore_index))
      continue;
    double top = -inf;
    for (int s = 0; s < d; ++s) top = std::max(top, at(s, i));
    double exps = 0, parts = 0;
    for (int s = 0; s < d; ++s) {
      exps += std::exp(at(s, i) - top);
      parts += at(s, n + i);
    }
    const double lse = top + std::log(exps);
    rows.lse[static_cast<std::size_t>(i)] = lse;
    rows.loss[static_cast<std::size_t>(i)] = lse + z * lse * lse - parts;
  }
  return rows;
}

// The rows not ignored.
std::int64_t counted(const std::vector<double>& labels, std::int64_t ignore_index) {
  return std::count_if(labels.begin(), labels.end(),
                       [&](double y) { return y != static_cast<double>(ignore_index); });
}

// The per-row losses reduced as `reduction` says (sum and mean in row order, in double), into
// `loss`.
void write_loss(const std::vector<double>& rows, std::int64_t count, Reduction reduction,
                const TensorView& loss, const Stream& stream) {
  if (reduction == Reduction::None) return write(rows, loss, stream);
  double sum = 0;
  for (double r : rows) sum += r;
  if (reduction == Reduction::Mean)
    sum = count ? sum / static_cast<double>(count) : std::numeric_limits<double>::quiet_NaN();
  write({sum}, loss, stream);
}

// cross_entropy on this rank's columns of the logits: (logits, labels) -> (loss, lse), the lse
// over the whole vocabulary.
void vocab_parallel_cross_entropy(const ProgramOp& op, const std::vector<TensorView>& in,
                                  const std::vector<TensorView>& out, Communicator& team,
                                  const Stream& stream) {
  const TensorView &logits = in[0], &labels = in[1];
  const std::int64_t n = logits.size(0);
  CrossEntropyOptions per_row = op.loss;
  per_row.reduction = Reduction::None;
  const Tensor loss_s({n}, row_loss_dtype(logits.dtype()), logits.device(), stream);
  const Tensor lse_s({n}, out[1].dtype(), logits.device(), stream);
  cross_entropy(logits, labels, loss_s, lse_s, per_row, stream);
  const std::vector<double> y = as_doubles(labels, stream);
  const Rows rows = combine_shards(lse_s, loss_s, logits.size(1), y, 0, op.loss, team, stream);
  write(rows.lse, out[1], stream);
  write_loss(rows.loss, counted(y, op.loss.ignore_index), op.loss.reduction, out[0], stream);
}

// fused_linear_cross_entropy with this rank's rows of the weight (its columns of the logits):
// (x, weight, bias, labels, grad_loss) -> (loss[, grad_x, grad_weight[, grad_bias]]). A chunk
// of rows at a time: the chunk's logits on this rank's columns (never the whole vocabulary, nor
// all rows), the statistics combined across the ranks, then, with gradients, the logits' gradient
// and its products: grad_x is this rank's term (Partial: the caller's plan sums it), grad_weight
// and grad_bias its rows. As in the one-device kernels (fused_linear_cross_entropy.h), 16-bit
// inputs give fp32 logits (the GEMM's fp32 sums unrounded: linear's f32 output) and grad_bias sums
// their fp32 gradient, computed in place (here each chunk's column sums in double, rounded once to
// the logits' dtype, added up in double and rounded once at the end); for the grad_x and
// grad_weight GEMMs the gradient is rounded once to the dtype, as the CUDA kernel does (the CPU one
// widens the operands instead). A 16-bit grad_weight takes one rounding per chunk (the GEMM adds
// each chunk's product to the running sum in fp32: that header's rule for a 16-bit grad_weight).
// Scratch: the chunk's logits, then their gradient, chunk x (V / d) elements of the logits' dtype
// (plus, for 16-bit inputs, the rounded gradient; and V / d elements each for a widened bias and
// grad_bias's sums), and a few per-row doubles.
void vocab_parallel_fused_linear_cross_entropy(const ProgramOp& op,
                                               const std::vector<TensorView>& in,
                                               const std::vector<TensorView>& out,
                                               Communicator& team, const Stream& stream) {
  const TensorView &x = in[0], &w = in[1], &b = in[2], &labels = in[3], &grad_loss = in[4];
  const std::int64_t n = x.size(0), vocab = w.size(0);
  const DType dt = x.dtype();
  const Device device = x.device();
  const bool grads = out.size() > 1;
  // On the host once: checked there in this op's name and rows (the kernel below is
  // cross_entropy on a chunk), and read as doubles by the combine.
  Tensor host_labels(labels.shape(), labels.dtype());
  copy(labels, host_labels, stream);
  const std::int64_t count =
      check_labels("fused_linear_cross_entropy", {dt, dt, labels.dtype(), n, vocab},
                   host_labels.view().data(), op.loss);
  const std::vector<double> y = as_doubles(host_labels, stream);
  // Each row's upstream gradient.
  std::vector<double> upstream;
  if (grads) {
    upstream = as_doubles(grad_loss, stream);
    if (op.loss.reduction != Reduction::None)
      upstream.assign(static_cast<std::size_t>(n),
                      op.loss.reduction == Reduction::Mean
                          ? upstream[0] / static_cast<double>(std::max<std::int64_t>(count, 1))
                          : upstream[0]);
  }
  // The same chunks on every rank (their statistics are gathered chunk by chunk): sized for the
  // largest shard, not this rank's. vocab_size is 0 where this rank holds the whole vocabulary
  // (a one-rank team).
  const std::int64_t largest =
      op.loss.vocab_size ? (op.loss.vocab_size + team.size() - 1) / team.size() : vocab;
  const DType logits_dtype = is_sixteen_bit(dt) ? DType::F32 : dt;  // f32 or f64: lse in f64
  // Scratch within the one-device kernel's chunk_rows x (V / d) x 4 bytes: with gradients, 16-bit
  // inputs hold fp32 logits and their gradient's 16-bit rounding, 6 bytes an element, in 2/3 of
  // the rows.
  std::int64_t chunk_rows = fused_linear_cross_entropy_chunk_rows(device.type, largest);
  if (grads && dt != logits_dtype) chunk_rows = chunk_rows * 2 / 3;
  const std::int64_t chunk = std::max<std::int64_t>(1, std::min(n, chunk_rows));
  const Tensor logits({chunk, vocab}, logits_dtype, device, stream);
  const Tensor loss_s({chunk}, logits_dtype, device, stream);
  const Tensor lse_s({chunk}, DType::F64, device, stream), lse({chunk}, DType::F64, device, stream);
  // A 16-bit bias widened once (linear takes a bias of its output's dtype).
  Tensor bias;
  if (b.defined() && b.dtype() != logits_dtype) {
    bias = Tensor(b.shape(), logits_dtype, device, stream);
    copy(b, bias, stream);
  }
  Tensor grad_logits, upstream_c, no_x, no_weight, bias_c, bias_c64, bias_sum;
  if (grads) {
    if (dt != logits_dtype) grad_logits = Tensor({chunk, vocab}, dt, device, stream);
    upstream_c = Tensor({chunk}, logits_dtype, device, stream);
    if (out.size() > 3) {
      // linear_backward's grad_bias alone (its column sum in double) of the gradient in the
      // logits' dtype: x and weight of width 0 in that dtype give it that (only their shapes are
      // read).
      no_x = Tensor({chunk, 0}, logits_dtype, device, stream);
      no_weight = Tensor({vocab, 0}, logits_dtype, device, stream);
      bias_c = Tensor({vocab}, logits_dtype, device, stream);
      bias_c64 = Tensor({vocab}, DType::F64, device, stream);
      bias_sum = Tensor({vocab}, DType::F64, device, stream);
    }
  }
  CrossEntropyOptions per_row = op.loss;
  per_row.reduction = Reduction::None;
  std::vector<double> losses;
  if (grads && n == 0)  // no chunk writes them
    for (std::size_t j = 2; j < out.size(); ++j)
      fill(out[j], 0.0, stream);
  for (std::int64_t first = 0; first < n; first += chunk) {
    const std::int64_t rows = std::min(chunk, n - first);
    const TensorView lg = logits.view().narrow(0, 0, rows), x_c = x.narrow(0, first, rows),
                     y_c = labels.narrow(0, first, rows);
    linear(x_c, w, bias.defined() ? bias.view() : b, lg, stream);
    cross_entropy(lg, y_c, loss_s.view().narrow(0, 0, rows), lse_s.view().narrow(0, 0, rows),
                  per_row, stream);
    const Rows r = combine_shards(lse_s.view().narrow(0, 0, rows), loss_s.view().narrow(0, 0, rows),
                                  vocab, y, first, op.loss, team, stream);
    losses.insert(losses.end(), r.loss.begin(), r.loss.end());
    if (!grads) continue;
    write(r.lse, lse.view().narrow(0, 0, rows), stream);
    write({upstream.begin() + first, upstream.begin() + first + rows},
          upstream_c.view().narrow(0, 0, rows), stream);
    cross_entropy_backward(upstream_c.view().narrow(0, 0, rows), lg, y_c,
                           lse.view().narrow(0, 0, rows), lg, per_row, stream);
    if (bias_c.defined()) {
      linear_backward(lg, no_x.view().narrow(0, 0, rows), no_weight, {}, {}, bias_c, stream);
      copy(bias_c, first ? bias_c64 : bias_sum, stream);
      if (first) add(bias_sum, bias_c64, bias_sum, 1.0, stream);
    }
    const TensorView gl = grad_logits.defined() ? grad_logits.view().narrow(0, 0, rows) : lg;
    if (grad_logits.defined()) copy(lg, gl, stream);
    gemm(gl, w, {}, out[1].narrow(0, first, rows), {}, stream);
    gemm(gl, x_c, first ? out[2] : TensorView(), out[2],
         {.transpose_a = true, .beta = first ? 1.0 : 0.0}, stream);
  }
  if (bias_sum.defined() && n > 0) copy(bias_sum, out[3], stream);
  write_loss(losses, count, op.loss.reduction, out[0], stream);
}

}  // namespace

void run_collective_op(const ProgramOp& op, const std::vector<TensorView>& in,
                       const std::vector<TensorView>& out, Communicator& team,
                       const Stream& stream) {
  if (op.type == OpType::CrossEntropy)
    return vocab_parallel_cross_entropy(op, in, out, team, stream);
  if (op.type == OpType::FusedLinearCrossEntropy)
    return vocab_parallel_fused_linear_cross_entropy(op, in, out, team, stream);
  fail(ErrorCode::Internal, "run_collective_op: {} has no collective form", to_string(op.type));
}

}  // namespace meshfuse::detail
