// RNN / GRU kernel interface shared by the front-end and the backends (internal).
#pragma once

#include <cstdint>

#include "meshfuse/core/dtype.h"
#include "meshfuse/core/stream.h"

namespace meshfuse::detail {

// All tensors are contiguous and of one floating dtype. Token rows: padded sequence b, step s is
// row b * seq_len + s; packed, it is row cu_seqlens[b] + s. An input row holds heads x head_dim
// values of its own head count; output rows hold heads x head_dim.
struct RecurrentShape {
  DType dtype;
  std::int64_t batch;     // B
  std::int64_t seq_len;   // padded: S; packed: the longest sequence (from the host check)
  std::int64_t heads;     // N
  std::int64_t head_dim;  // H
  // (B+1,) i64 offsets on the kernel's device, already checked; nullptr for padded input.
  const std::int64_t* cu_seqlens;
  // Head counts of the inputs and the weights, each dividing `heads`: [0] rnn / GRU candidate,
  // [1] GRU forget gate, [2] GRU reset gate. Head n reads head n / (heads / count).
  std::int64_t input_heads[3];
  std::int64_t weight_heads[3];
};

// Nullable pointers: input_state (zeros), final_state (not written), grad_output and
// grad_final_state (zeros), grad_input_state (not written). gradient_clipping: +inf = none.
using RnnForwardFn = void(const RecurrentShape&, const void* input, const void* weight,
                          const void* input_state, void* output, void* final_state,
                          const Stream&);
using RnnBackwardFn = void(const RecurrentShape&, const void* grad_output,
                           const void* grad_final_state, const void* output, const void* weight,
                           const void* input_state, void* grad_input, void* grad_weight,
                           void* grad_input_state, double gradient_clipping, const Stream&);

// The GRU's three (input, weight) pairs in RecurrentShape's order: candidate, forget, reset.
struct GruPointers {
  const void* input[3];
  const void* weight[3];
};
struct GruGradPointers {
  void* input[3];
  void* weight[3];
};

using GruForwardFn = void(const RecurrentShape&, const GruPointers&, const void* input_state,
                          void* output, void* final_state, const Stream&);
using GruBackwardFn = void(const RecurrentShape&, const void* grad_output,
                           const void* grad_final_state, const void* output, const GruPointers&,
                           const void* input_state, const GruGradPointers&,
                           void* grad_input_state, double gradient_clipping, const Stream&);

namespace reference {
RnnForwardFn rnn_forward;
RnnBackwardFn rnn_backward;
GruForwardFn gru_forward;
GruBackwardFn gru_backward;
}  // namespace reference

namespace cpu {
RnnForwardFn rnn_forward;
RnnBackwardFn rnn_backward;
GruForwardFn gru_forward;
GruBackwardFn gru_backward;
}  // namespace cpu

namespace cuda {
RnnForwardFn rnn_forward;
RnnBackwardFn rnn_backward;
GruForwardFn gru_forward;
GruBackwardFn gru_backward;
}  // namespace cuda

}  // namespace meshfuse::detail
