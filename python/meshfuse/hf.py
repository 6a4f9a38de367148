"""Hugging Face transformers models on meshfuse's kernels: ``patch(model)`` (also
``meshfuse.torch.patch``) for Llama, Mistral, Qwen2 and Mixtral's dense parts.

It swaps, on the model's own modules (no copy, the weights untouched):

- each ``*RMSNorm`` (``weight``, ``variance_epsilon``) for :func:`meshfuse.torch.rmsnorm`;
- each MLP with ``gate_proj`` / ``up_proj`` / ``down_proj`` and a SiLU activation for
  :func:`meshfuse.torch.swiglu_mlp` (Mixtral's experts are left as they are);
- the causal-LM loss: with ``labels`` (or ``shift_labels``), the forward runs the base model and
  :func:`meshfuse.torch.fused_linear_cross_entropy` over its last hidden state and ``lm_head``, with
  transformers' label shift, ignore index and ``num_items_in_batch`` scaling, and an fp32 loss as
  transformers' (which upcasts the logits). The (tokens, vocabulary) logits are then never made:
  the output's ``logits`` is None. Without labels the forward is transformers' own.
  Mixtral keeps its own loss when it adds the router's auxiliary loss (``output_router_logits``).

The same idea as Liger-Kernel's ``apply_liger_kernel_to_llama``, written against transformers'
module structure rather than each model's source.
"""

import inspect
import types

import torch

from . import torch as mt

ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral")


def _rmsnorm_forward(self, hidden_states):
    if hidden_states.dtype != self.weight.dtype:  # meshfuse takes one dtype: transformers' then
        return type(self).forward(self, hidden_states)
    return mt.rmsnorm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return mt.swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                         self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias)


def _causal_lm_forward(self, *args, **kwargs):
    original = type(self).forward
    signature = inspect.signature(original)
    arguments = dict(signature.bind(self, *args, **kwargs).arguments)
    arguments.pop("self")
    for name, parameter in signature.parameters.items():  # **kwargs: passed on by name
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    labels = arguments.pop("labels", None)
    shift_labels = arguments.pop("shift_labels", None)
    if labels is None and shift_labels is None:
        return original(self, *args, **kwargs)
    arguments.pop("logits_to_keep", None)
    num_items_in_batch = arguments.pop("num_items_in_batch", None)
    outputs = self.model(**arguments)
    hidden = outputs.last_hidden_state
    if shift_labels is None:  # transformers' ForCausalLMLoss: tokens < n predict n
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    sixteen_bit = hidden.dtype in (torch.bfloat16, torch.float16)
    loss = mt.fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
        shift_labels.reshape(-1).to(hidden.device), self.lm_head.bias,
        reduction="mean" if num_items_in_batch is None else "sum",
        loss_dtype=torch.float32 if sixteen_bit else None)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    return _causal_lm_output(loss=loss, logits=None, **rest)


def _causal_lm_output(**fields):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(**fields)


def patch(model, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True):
    """Puts meshfuse's kernels into a transformers Llama, Mistral, Qwen2 or Mixtral model (a
    ``*ForCausalLM`` or its base model), in place; returns the model.

    rms_norm, swiglu, fused_linear_cross_entropy: which swaps to make (module docstring). Raises
    ValueError for another architecture (``model.config.model_type``)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"meshfuse.torch.patch: model_type {model_type!r} is not one of "
                         f"{', '.join(ARCHITECTURES)}")
    config = model.config
    silu = getattr(config, "hidden_act", "silu") in ("silu", "swish")
    for module in model.modules():
        if rms_norm and type(module).__name__.endswith("RMSNorm") and \
                hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rmsnorm_forward, module)
        elif swiglu and silu and all(hasattr(module, name) for name in
                                     ("gate_proj", "up_proj", "down_proj")):
            module.forward = types.MethodType(_mlp_forward, module)
    router_loss = model_type == "mixtral" and getattr(config, "output_router_logits", False)
    if fused_linear_cross_entropy and hasattr(model, "lm_head") and not router_loss:
        model.forward = types.MethodType(_causal_lm_forward, model)
    return model
