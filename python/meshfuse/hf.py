"""Hugging Face transformers models on meshfuse's kernels: ``patch(model)`` (also
``meshfuse.torch.patch``) for Llama, Mistral, Qwen2 and Mixtral's dense parts.

It swaps, on the model's own modules (no copy, the weights untouched):

- each ``*RMSNorm`` (``weight``, ``variance_epsilon``) for :func:`meshfuse.torch.rmsnorm`;
- each MLP with ``gate_proj`` / ``up_proj`` / ``down_proj`` and a SiLU activation for
  :func:`meshfuse.torch.mlp_forward`, which calls the projections (LoRA adapters and hooks on them
  take part) and runs meshfuse's activation (Mixtral's experts are left as they are);
- the causal-LM loss of a training step (``model.training`` and grad enabled): with ``labels`` (or
  ``shift_labels``), the forward runs the base model and
  :func:`meshfuse.torch.fused_linear_cross_entropy` over its last hidden state and ``lm_head``, with
  transformers' label shift, ignore index and ``num_items_in_batch`` scaling, and an fp32 loss as
  transformers' (which upcasts the logits). The (tokens, vocabulary) logits are then never made:
  the output's ``logits`` is None (None at index 1 of the tuple of ``return_dict=False``, every
  other field where the unpatched model's tuple has it). Without labels, in eval mode or under no_grad
  (evaluation and prediction, which want the logits), or with an ``lm_head`` that is not a plain
  ``torch.nn.Linear`` without hooks (a LoRA adapter, a quantised linear) the forward is the
  model's own.
  Mixtral keeps its own loss when it adds the router's auxiliary loss (``output_router_logits``,
  in the call or else in the config), and so does a model with a loss function of the caller's
  (``model.loss_function = ...``, another ``loss_type``) or a call with ``logits_to_keep`` (labels
  for the kept positions only) or another ``ignore_index``. An ``lm_head`` of another dtype than
  the hidden states (fp32 under bf16 autocast) is cast to theirs, as autocast casts it.

The patched forwards keep the signature of the module's class (transformers' ``generate`` and
Trainer read it). A model saved whole (``torch.save(model)``) loads with its class's forwards:
patch it again.

Every path meshfuse does not take calls the forward the module had before ``patch``. Models with
accelerate hooks (dispatched by ``device_map=`` over several devices, or offloaded) are refused:
the fused forwards read the weights directly, around the hooks that move or load them.

The same idea as Liger-Kernel's ``apply_liger_kernel_to_llama``, written against transformers'
module structure rather than each model's source.
"""

import dataclasses
import inspect
import types

import torch

from . import torch as mt

ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral")

# The forward each patched module had before patch (a bound method, kept on the module so that a
# deepcopy of the model rebinds it to the copy): the paths meshfuse does not take call it.
_UNPATCHED = "_meshfuse_unpatched_forward"
# patch's accum_dtype, kept on the model for the fused loss's forward.
_ACCUM_DTYPE = "_meshfuse_accum_dtype"
# The causal LM's output class and its field names, found when patching: torch.compile's
# fullgraph tracing stops at dataclasses.fields.
_OUTPUT = "_meshfuse_output_class"


def _unpatched(module):
    return getattr(module, _UNPATCHED)


def _rmsnorm_forward(self, hidden_states):
    if hidden_states.dtype != self.weight.dtype:  # meshfuse takes one dtype: transformers' then
        return _unpatched(self)(hidden_states)
    return mt.rmsnorm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return mt.mlp_forward(self, x)


def _output_class_and_fields(forward):
    # The output class the model's own forward returns, and its fields (its return annotation:
    # MoeCausalLMOutputWithPast for Mixtral), CausalLMOutputWithPast when it names none.
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    annotation = inspect.signature(forward).return_annotation
    if isinstance(annotation, str):  # postponed annotations: a name in the forward's module
        annotation = getattr(inspect.unwrap(forward), "__globals__", {}).get(annotation)
    if not (isinstance(annotation, type) and issubclass(annotation, ModelOutput)):
        annotation = CausalLMOutputWithPast
    return annotation, frozenset(f.name for f in dataclasses.fields(annotation))


def _keeps_every_position(logits_to_keep):
    # transformers' logits_to_keep: 0 (every position), k (the last k), or positions (a tensor).
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def _causal_lm_forward(self, *args, **kwargs):
    unpatched = _unpatched(self)
    # Only a training step takes the fused loss: evaluation and prediction (HF Trainer's
    # prediction_step, compute_metrics, perplexity scripts) need the logits, and eval mode or
    # no_grad is where they are asked for.
    if not (self.training and torch.is_grad_enabled()):
        return unpatched(*args, **kwargs)
    # The fused loss reads lm_head's weight: an lm_head that is more than that (a LoRA adapter, a
    # quantised linear, hooks) runs as the model's own.
    if not mt._plain_linear(self.lm_head):
        return unpatched(*args, **kwargs)
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
        return unpatched(*args, **kwargs)
    # The fused loss is transformers' ForCausalLMLoss over every position with ignore index -100:
    # a loss of the caller's (model.loss_function set, another loss_type), logits kept at some
    # positions only (labels for those) or another ignore_index take the model's own forward.
    from transformers.loss.loss_utils import LOSS_MAPPING
    if self.loss_function is not LOSS_MAPPING["ForCausalLM"] or \
            not _keeps_every_position(arguments.get("logits_to_keep", 0)) or \
            arguments.get("ignore_index", -100) != -100:
        return unpatched(*args, **kwargs)
    # Mixtral adds the router's auxiliary loss to the loss when output_router_logits is set, in
    # the call or else in the config: its own forward (and loss) then.
    router_logits = arguments.get("output_router_logits")
    if router_logits is None:
        router_logits = getattr(self.config, "output_router_logits", False)
    if router_logits:
        return unpatched(*args, **kwargs)
    return_dict = arguments.pop("return_dict", None)  # as transformers' can_return_tuple
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    arguments.pop("logits_to_keep", None)
    num_items_in_batch = arguments.pop("num_items_in_batch", None)
    outputs = self.model(**arguments, return_dict=True)
    if isinstance(outputs, tuple):  # a base model that ignores return_dict
        hidden, rest = outputs[0], {}
    else:
        hidden = outputs.last_hidden_state
        rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    if shift_labels is None:  # transformers' ForCausalLMLoss: tokens < n predict n
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    sixteen_bit = hidden.dtype in (torch.bfloat16, torch.float16)
    # An lm_head of another dtype than the hidden states (fp32 under bf16 autocast): cast as
    # autocast casts it for the model's own linear.
    weight, bias = self.lm_head.weight, self.lm_head.bias
    if weight.dtype != hidden.dtype:
        weight, bias = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    loss = mt.fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight,
        shift_labels.reshape(-1).to(hidden.device), bias,
        reduction="mean" if num_items_in_batch is None else "sum",
        loss_dtype=torch.float32 if sixteen_bit else None,
        accum_dtype=getattr(self, _ACCUM_DTYPE, None))
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    output_class, fields = getattr(self, _OUTPUT)
    output = output_class(loss=loss, logits=None,
                          **{k: v for k, v in rest.items() if k in fields})
    if return_dict:
        return output
    # The unpatched tuple's layout (can_return_tuple's to_tuple, which drops None fields), with None
    # where the logits were: outputs[1] is then not silently the next field (as Liger's tuple).
    return (loss, None) + output.to_tuple()[1:]


def _replace_forward(module, forward):
    # The module's current forward (bound), for the paths meshfuse leaves to it; a second patch
    # keeps the first one's.
    if not hasattr(module, _UNPATCHED):
        setattr(module, _UNPATCHED, module.forward)

    def patched(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    # With the module's own signature: transformers reads it (generate builds the attention mask
    # and position ids only for a forward that names them, and asks for logits_to_keep; Trainer
    # keeps only the batch columns the forward names). Named "forward": pickle rebinds a bound
    # method by its name, so a model saved whole loads with its class's forward (unpatched).
    patched.__signature__ = inspect.signature(type(module).forward)
    patched.__name__ = "forward"
    patched.__qualname__ = f"{type(module).__qualname__}.forward"
    module.forward = types.MethodType(patched, module)


def _refuse_hooks(model):
    # accelerate's hooks (a model loaded with device_map= over several devices, or offloaded)
    # live in the module's instance forward, move its inputs and load its offloaded weights
    # before it runs; meshfuse's forwards read the weights of the module and of its children
    # (gate_proj, lm_head, ...) directly, around those hooks.
    for name, module in model.named_modules():
        if hasattr(module, "_hf_hook"):
            raise ValueError(
                f"meshfuse.torch.patch: module {name or type(module).__name__!r} has accelerate "
                "hooks (a model dispatched with device_map= over several devices, or offloaded), "
                "which meshfuse's forwards would bypass; patch a model on one device (loaded "
                "with device_map=None or a single device)")


def patch(model, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, *,
          accum_dtype=None):
    """Puts meshfuse's kernels into a transformers Llama, Mistral, Qwen2 or Mixtral model (a
    ``*ForCausalLM`` or its base model), in place; returns the model.

    rms_norm, swiglu, fused_linear_cross_entropy: which swaps to make (module docstring).
    accum_dtype: the fused loss's (:func:`meshfuse.torch.fused_linear_cross_entropy`): None sums
    lm_head's weight gradient in float32 for a 16-bit model, the model's dtype (e.g.
    ``torch.bfloat16``) holds no float32 copy of it (less memory, one rounding per chunk). Raises
    ValueError for another architecture (``model.config.model_type``), for a model with
    accelerate hooks (``device_map=`` over several devices, offloading) and for an accum_dtype
    without the fused loss, TypeError for an accum_dtype that is not a torch.dtype, before
    changing anything."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"meshfuse.torch.patch: model_type {model_type!r} is not one of "
                         f"{', '.join(ARCHITECTURES)}")
    _refuse_hooks(model)
    if accum_dtype is not None and not isinstance(accum_dtype, torch.dtype):
        raise TypeError(f"meshfuse.torch.patch: accum_dtype must be None or a torch.dtype, got "
                        f"{accum_dtype!r}")
    if accum_dtype is not None and not fused_linear_cross_entropy:
        raise ValueError("meshfuse.torch.patch: accum_dtype is the fused loss's, which "
                         "fused_linear_cross_entropy=False leaves out")
    config = model.config
    silu = getattr(config, "hidden_act", "silu") in ("silu", "swish")
    for module in model.modules():
        if rms_norm and type(module).__name__.endswith("RMSNorm") and \
                hasattr(module, "variance_epsilon"):
            _replace_forward(module, _rmsnorm_forward)
        elif swiglu and silu and all(hasattr(module, name) for name in
                                     ("gate_proj", "up_proj", "down_proj")):
            _replace_forward(module, _mlp_forward)
    if fused_linear_cross_entropy and hasattr(model, "lm_head"):
        setattr(model, _ACCUM_DTYPE, accum_dtype)
        setattr(model, _OUTPUT, _output_class_and_fields(type(model).forward))
        _replace_forward(model, _causal_lm_forward)
    return model
