// rnn and gru (forward and backward) in the _meshfuse extension: arrays in, caller-allocated
// outputs written in place, the GIL released while they run.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "arrays.h"
#include "meshfuse/ops/recurrent.h"

namespace meshfuse::python {
namespace {

using namespace nb::literals;
using In = nb::ndarray<nb::ro>;
using Out = Output;
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;

}  // namespace

void bind_recurrent(nb::module_& m) {
  const auto release = nb::call_guard<nb::gil_scoped_release>();
  m.def(
      "rnn",
      [](In input, In weight, OptIn input_state, Out output, OptOut final_state, OptIn cu_seqlens,
         std::int64_t max_seqlen, std::uintptr_t stream) {
        rnn(view(input, "rnn", "input"), view(weight, "rnn", "weight"),
            view(input_state, "rnn", "input_state"), view(output, "rnn", "output"),
            view(final_state, "rnn", "final_state"), view(cu_seqlens, "rnn", "cu_seqlens"),
            max_seqlen, stream_on(device_of(input), stream));
      },
      "input"_a, "weight"_a, "input_state"_a.none(), "output"_a, "final_state"_a.none(),
      "cu_seqlens"_a.none() = nb::none(), "max_seqlen"_a = -1, "stream"_a = 0, release,
      "Multi-head RNN, h_t = tanh(h_(t-1) @ weight[n] + input_t) (Elman 1990): input (B, S, N, "
      "H), or packed (T, N, H) with cu_seqlens (B+1,); weight (N, H, H); input_state (B, N, H) "
      "or None; output like input, final_state (B, N, H) or None; one float dtype (float32, "
      "float64, bfloat16, float16; 16-bit computed in fp32, rounded once). Raises "
      "meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). Spec: meshfuse/ops/recurrent.h. Outputs are caller-allocated arrays "
      "written in place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its "
      "default stream).");
  m.def(
      "rnn_backward",
      [](OptIn grad_output, OptIn grad_final_state, In output, In weight, OptIn input_state,
         Out grad_input, Out grad_weight, OptOut grad_input_state,
         std::optional<double> gradient_clipping, OptIn cu_seqlens, std::int64_t max_seqlen,
         std::uintptr_t stream) {
        rnn_backward(view(grad_output, "rnn_backward", "grad_output"),
                     view(grad_final_state, "rnn_backward", "grad_final_state"),
                     view(output, "rnn_backward", "output"), view(weight, "rnn_backward", "weight"),
                     view(input_state, "rnn_backward", "input_state"),
                     view(grad_input, "rnn_backward", "grad_input"),
                     view(grad_weight, "rnn_backward", "grad_weight"),
                     view(grad_input_state, "rnn_backward", "grad_input_state"), gradient_clipping,
                     view(cu_seqlens, "rnn_backward", "cu_seqlens"), max_seqlen,
                     stream_on(device_of(output), stream));
      },
      "grad_output"_a.none(), "grad_final_state"_a.none(), "output"_a, "weight"_a,
      "input_state"_a.none(), "grad_input"_a, "grad_weight"_a, "grad_input_state"_a.none(),
      "gradient_clipping"_a.none() = nb::none(), "cu_seqlens"_a.none() = nb::none(),
      "max_seqlen"_a = -1, "stream"_a = 0, release,
      "grad_input, grad_weight and grad_input_state (or None) of rnn for grad_output and "
      "grad_final_state (either may be None: zeros), from the forward's output; "
      "gradient_clipping c clamps the state's gradient to [-c, c] each step. Raises "
      "meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). Spec: meshfuse/ops/recurrent.h. Outputs are caller-allocated arrays "
      "written in place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its "
      "default stream).");
  m.def(
      "gru",
      [](In input, In weight, In forget_input, In forget_weight, In reset_input, In reset_weight,
         OptIn input_state, Out output, OptOut final_state, OptIn cu_seqlens,
         std::int64_t max_seqlen, std::uintptr_t stream) {
        gru({view(input, "gru", "input"), view(weight, "gru", "weight"),
             view(forget_input, "gru", "forget_input"), view(forget_weight, "gru", "forget_weight"),
             view(reset_input, "gru", "reset_input"), view(reset_weight, "gru", "reset_weight")},
            view(input_state, "gru", "input_state"), view(output, "gru", "output"),
            view(final_state, "gru", "final_state"), view(cu_seqlens, "gru", "cu_seqlens"),
            max_seqlen, stream_on(device_of(input), stream));
      },
      "input"_a, "weight"_a, "forget_input"_a, "forget_weight"_a, "reset_input"_a, "reset_weight"_a,
      "input_state"_a.none(), "output"_a, "final_state"_a.none(),
      "cu_seqlens"_a.none() = nb::none(), "max_seqlen"_a = -1, "stream"_a = 0, release,
      "Multi-head GRU (Cho et al. 2014, arXiv:1406.1078): f = sigmoid(h @ forget_weight[n] + "
      "forget_input_t), r = sigmoid(h @ reset_weight[n] + reset_input_t), z = tanh((h * r) @ "
      "weight[n] + input_t), h = f * h + (1 - f) * z; shapes as rnn. Raises meshfuse.Error "
      "subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), DTypeMismatchError "
      "(TypeError), DeviceMismatchError, BackendUnavailableError (RuntimeError). Spec: "
      "meshfuse/ops/recurrent.h. Outputs are caller-allocated arrays written in place; `stream` "
      "is a cudaStream_t as an integer on the arrays' device (0: its default stream).");
  m.def(
      "gru_backward",
      [](OptIn grad_output, OptIn grad_final_state, In output, In input, In weight, In forget_input,
         In forget_weight, In reset_input, In reset_weight, OptIn input_state, Out grad_input,
         Out grad_weight, Out grad_forget_input, Out grad_forget_weight, Out grad_reset_input,
         Out grad_reset_weight, OptOut grad_input_state, std::optional<double> gradient_clipping,
         OptIn cu_seqlens, std::int64_t max_seqlen, std::uintptr_t stream) {
        gru_backward(view(grad_output, "gru_backward", "grad_output"),
                     view(grad_final_state, "gru_backward", "grad_final_state"),
                     view(output, "gru_backward", "output"),
                     {view(input, "gru_backward", "input"), view(weight, "gru_backward", "weight"),
                      view(forget_input, "gru_backward", "forget_input"),
                      view(forget_weight, "gru_backward", "forget_weight"),
                      view(reset_input, "gru_backward", "reset_input"),
                      view(reset_weight, "gru_backward", "reset_weight")},
                     view(input_state, "gru_backward", "input_state"),
                     {view(grad_input, "gru_backward", "grad_input"),
                      view(grad_weight, "gru_backward", "grad_weight"),
                      view(grad_forget_input, "gru_backward", "grad_forget_input"),
                      view(grad_forget_weight, "gru_backward", "grad_forget_weight"),
                      view(grad_reset_input, "gru_backward", "grad_reset_input"),
                      view(grad_reset_weight, "gru_backward", "grad_reset_weight")},
                     view(grad_input_state, "gru_backward", "grad_input_state"), gradient_clipping,
                     view(cu_seqlens, "gru_backward", "cu_seqlens"), max_seqlen,
                     stream_on(device_of(output), stream));
      },
      "grad_output"_a.none(), "grad_final_state"_a.none(), "output"_a, "input"_a, "weight"_a,
      "forget_input"_a, "forget_weight"_a, "reset_input"_a, "reset_weight"_a,
      "input_state"_a.none(), "grad_input"_a, "grad_weight"_a, "grad_forget_input"_a,
      "grad_forget_weight"_a, "grad_reset_input"_a, "grad_reset_weight"_a,
      "grad_input_state"_a.none(), "gradient_clipping"_a.none() = nb::none(),
      "cu_seqlens"_a.none() = nb::none(), "max_seqlen"_a = -1, "stream"_a = 0, release,
      "The gradients of every gru input (grad_input_state may be None) for grad_output and "
      "grad_final_state (either may be None: zeros); gradient_clipping as rnn_backward. Raises "
      "meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). Spec: meshfuse/ops/recurrent.h. Outputs are caller-allocated arrays "
      "written in place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its "
      "default stream).");
}

}  // namespace meshfuse::python
