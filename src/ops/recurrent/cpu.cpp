// CPU RNN and GRU: for now the reference loops (the optimised kernels follow).
#include "ops/recurrent/recurrent_kernels.h"

namespace meshfuse::detail::cpu {

void rnn_forward(const RecurrentShape& s, const void* input, const void* weight,
                 const void* input_state, void* output, void* final_state, const Stream& stream) {
  reference::rnn_forward(s, input, weight, input_state, output, final_state, stream);
}

void rnn_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const void* weight, const void* input_state, void* grad_input,
                  void* grad_weight, void* grad_input_state, double gradient_clipping,
                  const Stream& stream) {
  reference::rnn_backward(s, grad_output, grad_final_state, output, weight, input_state, grad_input,
                          grad_weight, grad_input_state, gradient_clipping, stream);
}

void gru_forward(const RecurrentShape& s, const GruPointers& p, const void* input_state,
                 void* output, void* final_state, const Stream& stream) {
  reference::gru_forward(s, p, input_state, output, final_state, stream);
}

void gru_backward(const RecurrentShape& s, const void* grad_output, const void* grad_final_state,
                  const void* output, const GruPointers& p, const void* input_state,
                  const GruGradPointers& grads, void* grad_input_state, double gradient_clipping,
                  const Stream& stream) {
  reference::gru_backward(s, grad_output, grad_final_state, output, p, input_state, grads,
                          grad_input_state, gradient_clipping, stream);
}

}  // namespace meshfuse::detail::cpu
