// Multi-head RNN and GRU over padded or packed variable-length sequences (the recurrences of the
// seed kernel library; GRU after Cho et al. 2014, "Learning Phrase Representations using RNN
// Encoder-Decoder", arXiv:1406.1078, in the row-vector form used there: h @ W, not W @ h).
//
// Per head n and per sequence, with h_0 = input_state (zeros when undefined):
//   rnn:  h_t = tanh(h_{t-1} @ W[n] + x_t)
//   gru:  f   = sigmoid(h_{t-1} @ W_f[n] + x_f,t)
//         r   = sigmoid(h_{t-1} @ W_r[n] + x_r,t)
//         z   = tanh((h_{t-1} * r) @ W[n] + x_t)
//         h_t = f * h_{t-1} + (1 - f) * z
// output[t] = h_t; final_state = h at the end of each sequence (its input state, or zeros, for an
// empty sequence).
//
// Shapes (B sequences, N heads of size H):
//   padded: input (B, S, Nx, H), output (B, S, N, H); every sequence has length S.
//   packed: input (T, Nx, H), output (T, N, H), cu_seqlens (B+1,) i32, u32 or i64 with
//           cu_seqlens[0] = 0, non-decreasing, cu_seqlens[B] = T; sequence b is rows
//           [cu_seqlens[b], cu_seqlens[b+1]). Empty sequences (repeated offsets) are allowed.
//   weight (Nw, H, H); input_state, final_state (B, N, H).
// Head broadcasting: each input and each weight may have fewer heads than N (Nx, Nw), as long as
// the count divides N; head k of such a tensor serves the N / Nx consecutive heads
// k * (N / Nx) ... (k + 1) * (N / Nx) - 1 (like grouped-query attention's key/value heads).
// N is the largest head count among the inputs, weights and input_state; every count must divide
// it. The gradient of a broadcast tensor is the sum over the heads it serves.
//
// max_seqlen: packed input only (-1 = unknown, the only value allowed for padded input); when
// given it must be >= the longest sequence. cu_seqlens is read on the host to check it (a small
// device-to-host copy and stream synchronisation when it lives on a GPU).
//
// Dtypes: inputs, weights, states, outputs and gradients share one dtype: f32, f64, bf16 or f16.
// The state is carried in fp32 (f64 for f64) across time steps and rounded once per stored value;
// the backward recomputes the gates from the stored (rounded) outputs. Weight gradients are
// reduced in fp32 (f64) in a fixed order: bitwise the same run to run.
//
// Scratch (stream-ordered, freed on return): the cuda backward keeps fp32 weight-gradient
// partials per group of 8 sequences and head, ceil(B / 8) * N * H * H * 4 bytes per weight (16
// MiB for B = 16, N = 64, H = 128; it grows with B: split very large batches), and, when an
// input has fewer heads than N, it reads cu_seqlens[B] back to the host once more.
//
// Backward: upstream gradients for output and final_state, each optional (undefined = zeros).
// gradient_clipping = c clamps the gradient of the state to [-c, c] at every step of the backward
// recurrence, before it flows into the previous step (as in the seed library); nullopt = no
// clipping. Precisely: the gradient of h_t (that of output[t], plus what flows back from step
// t+1, plus grad_final_state at the last step) is clamped, then taken back through step t; the
// gradient of input_state is what step 1 sends back, not clamped again. In PyTorch terms:
// h.register_hook(lambda g: g.clamp(-c, c)) on every new state h of a per-step loop. NaN stays
// NaN.
//
// Errors: DTypeMismatch (dtypes differ, not floating, cu_seqlens not i32/u32/i64), ShapeMismatch (a
// shape that does not follow the above, a head count that does not divide N), InvalidArgument
// (the input's rank not 4 without / 3 with cu_seqlens; cu_seqlens that does not start at 0,
// decreases or does not end at T; max_seqlen smaller than a sequence, or given for padded input;
// gradient_clipping negative or NaN; grad_input_state without input_state; an output not
// contiguous or sharing an operand's memory), DeviceMismatch,
// Unsupported / BackendUnavailable (see kernel_backend.h).
#pragma once

#include <cstdint>
#include <optional>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"

namespace meshfuse {

// input, weight and input_state (optional) as above. Writes output and, when defined,
// final_state.
void rnn(const TensorView& input, const TensorView& weight, const TensorView& input_state,
         const TensorView& output, const TensorView& final_state,
         const TensorView& cu_seqlens = {}, std::int64_t max_seqlen = -1,
         const Stream& stream = {});

// grad_output (like output) and grad_final_state ((B, N, H)) optional; output: the forward's.
// Writes grad_input (like input), grad_weight (like weight) and, when defined (needs
// input_state), grad_input_state (like input_state).
void rnn_backward(const TensorView& grad_output, const TensorView& grad_final_state,
                  const TensorView& output, const TensorView& weight,
                  const TensorView& input_state, const TensorView& grad_input,
                  const TensorView& grad_weight, const TensorView& grad_input_state,
                  std::optional<double> gradient_clipping = std::nullopt,
                  const TensorView& cu_seqlens = {}, std::int64_t max_seqlen = -1,
                  const Stream& stream = {});

// The three (input, weight) pairs of a GRU: the candidate z, the forget gate f, the reset gate r.
// Each input has the input shape above, each weight (Nw, H, H); head counts may differ per tensor.
struct GruParams {
  TensorView input, weight;
  TensorView forget_input, forget_weight;
  TensorView reset_input, reset_weight;
};

// Writes output and, when defined, final_state.
void gru(const GruParams& params, const TensorView& input_state, const TensorView& output,
         const TensorView& final_state, const TensorView& cu_seqlens = {},
         std::int64_t max_seqlen = -1, const Stream& stream = {});

// params and input_state: the forward's; output: the forward's output. grads receives, field by
// field, the gradient of each tensor of params (same shapes). grad_input_state as in
// rnn_backward.
void gru_backward(const TensorView& grad_output, const TensorView& grad_final_state,
                  const TensorView& output, const GruParams& params,
                  const TensorView& input_state, const GruParams& grads,
                  const TensorView& grad_input_state,
                  std::optional<double> gradient_clipping = std::nullopt,
                  const TensorView& cu_seqlens = {}, std::int64_t max_seqlen = -1,
                  const Stream& stream = {});

}  // namespace meshfuse
