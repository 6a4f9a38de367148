"""PyTorch adapter: meshfuse's ops as PyTorch custom operators, with autograd and modules.

Every op is a ``torch.library.custom_op`` in the ``meshfuse`` namespace (``torch.ops.meshfuse.*``)
with a fake (meta) implementation and an autograd formula, so ``torch.compile`` sees each as one
opaque node: no graph break, and the backward kernel in the backward graph. An op allocates its
outputs with torch and runs on the current CUDA stream of its inputs' device (or the CPU).

Three layers:

- functions (``swiglu``, ``rmsnorm``, ``softmax``, ``cross_entropy``,
  ``fused_linear_cross_entropy``, ...): differentiable, the semantics of the matching
  ``torch.nn.functional`` call;
- modules (``RMSNorm``, ``SwiGLUMLP``, ``CrossEntropyLoss``, ``FusedLinearCrossEntropyLoss``)
  with PyTorch's constructor arguments;
- the raw kernels, ``*_forward`` / ``*_backward`` (no autograd, no custom op), for benchmarks and
  hand-written training loops.

Shapes, dtypes, the math and its source are specified in include/meshfuse/ops/*.h; errors are
``meshfuse.Error`` subclasses (``ValueError`` for a bad argument or shape, ``TypeError`` for a
dtype, ``RuntimeError`` for a device or backend).
"""

import functools
import math
import operator
import os
import warnings
from typing import Optional, Sequence

try:
    import torch
except ModuleNotFoundError as e:  # a bare "No module named 'torch'" does not say who wants it
    raise ModuleNotFoundError("meshfuse.torch needs PyTorch: pip install torch "
                              "(or pip install 'meshfuse[torch]')", name="torch") from e
import torch.autograd.forward_ad as _fwad  # noqa: E402
from torch import Tensor

from . import _meshfuse as _C

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _load_torch_ops():
    # meshfuse._torch_ops (python/src/torch_ops.cpp): the forward kernels of rmsnorm, softmax,
    # swiglu and cross_entropy called on torch tensors, with their outputs allocated in C++; built
    # where torch was importable at build time, against that torch's C++ ABI, so used only under
    # the same torch version (checked before the import: loaded under another it could crash).
    # None: the DLPack path of _meshfuse (same kernels, same results, more host time per call).
    # MESHFUSE_TORCH_OPS=0 turns it off (to compare the two).
    if os.environ.get("MESHFUSE_TORCH_OPS", "1") == "0":
        return None
    try:
        from ._torch_build import TORCH_VERSION
    except ImportError:  # built without torch
        return None
    problem = None
    if TORCH_VERSION != torch.__version__:
        problem = f"was built for torch {TORCH_VERSION}, this is torch {torch.__version__}"
    else:
        try:
            from . import _torch_ops
            if _torch_ops.TORCH_VERSION == TORCH_VERSION:
                return _torch_ops
            problem = (f"is a build for torch {_torch_ops.TORCH_VERSION} beside a record of "
                       f"{TORCH_VERSION}")
        except ImportError as e:
            problem = f"does not load ({e})"
    warnings.warn(
        f"meshfuse.torch: meshfuse's torch extension {problem}: using the DLPack path (same "
        f"results, more host time per call); reinstall meshfuse with pip install "
        f"--no-build-isolation to build it for this torch", RuntimeWarning, stacklevel=3)
    return None


_T = _load_torch_ops()


def has_torch_extension():
    """Whether the eager forward path of rmsnorm, softmax, swiglu and cross_entropy runs through
    meshfuse's torch extension (compiled for this torch version: the least host time per call)
    rather than the DLPack path (docs/PYTHON.md)."""
    return _T is not None


def _stream(t):
    # The current stream's cudaStream_t, as torch.compile's generated code reads it (no Stream
    # object made per call). Called inside the custom ops only, so torch.compile never traces it
    # (dynamo's torch.Stream has no cuda_stream).
    # get_device(): the index without a torch.device object.
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else 0


def _d(t):
    # A tensor as the DLPack capsule the extension takes: torch's C exporter costs ~0.5 us where
    # nanobind calling Tensor.__dlpack__ (Python, with its checks) costs ~7 us, for each argument
    # of every call (bench/python_overhead.py). No stream synchronisation either way (the kernels
    # run on the current stream, which _stream passes); the kernels record no autograd history,
    # so a tensor that requires grad goes as it is. The eager path's calls pass their arguments by
    # position: nanobind's keyword matching costs a noticeable part of a call (docs/PYTHON.md).
    # A lazy negation (torch._neg_view, x.conj().imag) exports its storage without the sign, so
    # it is materialised; every tensor the functions write through _d is one they allocated.
    if isinstance(t, Tensor):
        return _to_dlpack(t.resolve_neg() if t.is_neg() else t)
    return t  # None, or another DLPack array


_to_dlpack = torch.utils.dlpack.to_dlpack


def _rows(x):
    # The rows of a row-wise op: every dim but the last (as detail::leading_rows in C++).
    return math.prod(x.shape[:-1])


def _untraced(*tensors):
    # Whether a call may take the raw kernel instead of the custom op: eager, on plain tensors
    # (not fake or functional ones, which only the op's fake implementation takes), and not
    # recorded by autograd. The op's dispatch costs ~15 us per call on tiny inputs
    # (bench/python_overhead.py): most of a call there, as in decoding.
    # Tracers that see plain tensors record only what goes through the dispatcher, so the raw
    # kernel's result would be a constant in their graph: torch.jit.trace, and the dispatch or
    # function modes that make_fx (real mode), FX proxies and other interposers push. These checks
    # cost ~0.4 us (a loop: a generator expression cost twice as much).
    if _is_compiling() or _jit_tracing() or _dispatch_modes() or _function_modes():
        return False
    if _functorch_transforms() or _fwad._current_level >= 0:
        _refuse_forward_mode(tensors)
        return False
    grad = _grad_enabled()
    for t in tensors:
        # Meta tensors (no data to export) take the op, whose fake implementation serves them.
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad) or t.is_meta):
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a module's weights are Parameters
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_jit_tracing = torch._C._is_tracing  # torch.jit.is_tracing without its is_scripting check
_dispatch_modes = torch._C._len_torch_dispatch_stack  # active TorchDispatchModes
_function_modes = torch._C._is_torch_function_mode_enabled  # active TorchFunctionModes
# vmap and torch.func's grad wrap tensors that keep type Tensor but have no storage to export.
_functorch_transforms = torch._C._are_functorch_transforms_active


def _refuse_forward_mode(tensors):
    # The ops have no forward-mode derivative: under torch.func.jvp a custom op's tangent came out
    # as zeros, and the raw kernel dropped a dual tensor's tangent, both without an error. Called
    # only inside a functorch transform or a forward-AD level (the checks cost ~1 us a tensor).
    jvp = any(i.key() == torch._C._functorch.TransformType.Jvp
              for i in (torch._C._functorch.get_interpreter_stack() or ())) or \
        (_fwad._current_level >= 0 and any(
            t is not None and _fwad.unpack_dual(t).tangent is not None for t in tensors))
    if jvp:
        raise NotImplementedError(
            "meshfuse.torch: the ops have no forward-mode derivative (torch.func.jvp, jacfwd, "
            "torch.autograd.forward_ad); use autograd's reverse mode (backward, torch.autograd.grad)")


def _empty_like(x):
    # A contiguous tensor like x. The memory_format argument costs ~0.4 us of a ~2 us allocation,
    # and empty_like of a contiguous tensor is contiguous without it.
    if x.is_contiguous():
        return torch.empty_like(x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# A custom op returns tensors, never None: an output not computed is _nothing(), a (0,) tensor.
def _nothing(like):
    return like.new_empty(0)


def _fake(op):
    """``op.register_fake`` with a check that no argument is on the meta device beside one that is
    not: torch sends such a call to the fake implementation, whose outputs (on the other tensors'
    device) would come back as the result, never written."""
    name = getattr(op, "_name", "meshfuse")  # the op's name without its namespace

    def register(fn):
        code = fn.__code__
        names = code.co_varnames[:code.co_argcount]

        @functools.wraps(fn)
        def checked(*args):
            tensors = [(names[i] if i < len(names) else f"argument {i}", a)
                       for i, a in enumerate(args) if isinstance(a, Tensor)]
            meta = [(n, t) for n, t in tensors if t.is_meta]
            other = [(n, t) for n, t in tensors if not t.is_meta]
            if meta and other:
                raise _C.DeviceMismatchError(
                    f"[device mismatch] {name}: '{meta[0][0]}' is on the meta device and "
                    f"'{other[0][0]}' on {other[0][1].device}: meta tensors have shapes but no "
                    f"data (pass every tensor on the meta device, or none)")
            return fn(*args)

        return op.register_fake(checked)

    return register


# --- swiglu ----------------------------------------------------------------------------------
def swiglu_forward(gate, up):
    """The raw kernel of :func:`swiglu`: returns ``up * silu(gate)``."""
    if _T is not None:
        return _T.swiglu(gate, up)
    out = _empty_like(gate)
    _C.swiglu(_d(gate), _d(up), _d(out), _stream(gate))
    return out


def swiglu_backward(grad_out, gate, up):
    """The raw backward of :func:`swiglu`: returns (grad_gate, grad_up)."""
    grad_gate, grad_up = _empty_like(gate), _empty_like(up)
    _C.swiglu_backward(_d(grad_out), _d(gate), _d(up), _d(grad_gate), _d(grad_up),
                       stream=_stream(gate))
    return grad_gate, grad_up


@torch.library.custom_op("meshfuse::swiglu", mutates_args=())
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return swiglu_forward(gate, up)


@_fake(_swiglu)
def _(gate, up):
    return _empty_like(gate)


@torch.library.custom_op("meshfuse::swiglu_backward", mutates_args=())
def _swiglu_backward(grad_out: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return swiglu_backward(grad_out, gate, up)


@_fake(_swiglu_backward)
def _(grad_out, gate, up):
    return _empty_like(gate), _empty_like(up)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, grad_out):
    return _swiglu_backward(grad_out, *ctx.saved_tensors)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


# swiglu whose backward writes grad_gate over gate and grad_up over up (the kernel allows it:
# include/meshfuse/ops/swiglu.h), for callers whose gate and up are their own intermediates
# (swiglu_mlp): the backward allocates nothing, as Liger's MLP. The op declares its mutation, so
# torch bumps their version counters, and the backward refuses to run twice (saved-tensor hooks
# skip the version check): a second backward raises instead of reading gradients as activations.
@torch.library.custom_op("meshfuse::swiglu_backward_", mutates_args=("gate", "up"))
def _swiglu_backward_in_place(grad_out: Tensor, gate: Tensor, up: Tensor) -> None:
    _C.swiglu_backward(_d(grad_out), _d(gate), _d(up), _d(gate), _d(up), stream=_stream(gate))


@_fake(_swiglu_backward_in_place)
def _(grad_out, gate, up):
    return None


@torch.library.custom_op("meshfuse::swiglu_reusing_inputs", mutates_args=())
def _swiglu_reusing_inputs(gate: Tensor, up: Tensor) -> Tensor:
    return swiglu_forward(gate, up)


@_fake(_swiglu_reusing_inputs)
def _(gate, up):
    return _empty_like(gate)


def _swiglu_reusing_inputs_grad(ctx, grad_out):
    # Before saved_tensors, whose version check would raise torch's generic in-place error.
    if getattr(ctx, "overwritten", False):
        raise RuntimeError("swiglu_mlp: a second backward through the same graph: its first wrote "
                           "the activation's gradients over its saved inputs (gate and up); run "
                           "the forward again")
    gate, up = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: gate and up's history is the forward's
        return _swiglu_backward(grad_out, gate, up)
    ctx.overwritten = True
    _swiglu_backward_in_place(grad_out, gate, up)
    return gate, up


_swiglu_reusing_inputs.register_autograd(_swiglu_reusing_inputs_grad,
                                         setup_context=_swiglu_setup)


def swiglu(gate, up):
    """``up * silu(gate)``, the SwiGLU activation (Shazeer 2020, "GLU Variants Improve
    Transformer", arXiv:2002.05202): ``F.silu(gate) * up``.

    gate, up: (..., I), one dtype (float32, float64, bfloat16, float16; 16-bit computed in fp32)
    and device. Returns a contiguous tensor like gate. Raises ShapeMismatchError (ValueError),
    DTypeMismatchError (TypeError), DeviceMismatchError (RuntimeError). Spec:
    include/meshfuse/ops/swiglu.h."""
    if _untraced(gate, up):
        return swiglu_forward(gate, up)
    return _swiglu(gate, up)


# --- rmsnorm and fused residual-add rmsnorm ----------------------------------------------------
def _eps(x, eps):
    # torch.nn.functional.rms_norm's default: the machine epsilon of the computation type (fp32
    # for 16-bit inputs, as PyTorch's opmath).
    if eps is not None:
        return eps
    if not x.is_floating_point():  # (torch.finfo's own error names neither the op nor x)
        raise _C.DTypeMismatchError(f"[dtype mismatch] rmsnorm: x must be float32, float64, "
                                    f"bfloat16 or float16, got {x.dtype}")
    return torch.finfo(torch.float32 if x.dtype in _SIXTEEN_BIT else x.dtype).eps


def _rstd_dtype(dtype):
    # rmsnorm's saved statistic: float64 for float64 x, so that its gradients keep float64's
    # accuracy; float32 otherwise (C++ rmsnorm_rstd_dtype).
    return torch.float64 if dtype == torch.float64 else torch.float32


def rmsnorm_forward(x, weight, eps, residual=None, multiplier=1.0, save_rstd=True):
    """The raw kernel of :func:`rmsnorm` and :func:`fused_residual_add_rmsnorm`: returns
    (y, r or None, rstd (rows,) float32 (float64 for float64 x), or None when not ``save_rstd``:
    inference has no backward to save it for); r = x * multiplier + residual when a residual is
    given."""
    no_residual = residual is None and multiplier == 1.0
    if no_residual and _T is not None:
        y, rstd = _T.rmsnorm(x, weight, eps, save_rstd)
        return y, None, rstd
    y = _empty_like(x)
    rstd = torch.empty(_rows(x), dtype=_rstd_dtype(x.dtype), device=x.device) if save_rstd \
        else None
    if no_residual:
        _C.rmsnorm(_d(x), _d(weight), _d(y), _d(rstd), eps, _stream(x))
        return y, None, rstd
    r = None if residual is None else torch.empty_like(y)
    _C.fused_residual_add_rmsnorm(_d(x), _d(residual), _d(weight), _d(y), _d(r), _d(rstd), eps,
                                  multiplier, _stream(x))
    return y, r, rstd


def rmsnorm_backward(grad_y, saved, weight, rstd, residual_given, multiplier=1.0, grad_r=None,
                     need_dweight=True):
    """The raw backward. saved: r when a residual was given, else x. Returns (dx, dresidual or
    None, dweight or None); with a residual and multiplier 1, dresidual is dx itself (the same
    tensor: the kernel writes it once)."""
    dx = _empty_like(saved)
    dweight = torch.empty_like(weight) if weight is not None and need_dweight else None
    if not residual_given and multiplier == 1.0:
        _C.rmsnorm_backward(_d(grad_y), _d(saved), _d(weight), _d(rstd), _d(dx), _d(dweight),
                            stream=_stream(saved))
        return dx, None, dweight
    # With multiplier 1 the residual's gradient equals dx: dx itself is passed as dresidual and
    # written once, and returned for both (as torch's add backward gives both inputs one tensor).
    if residual_given:
        dresidual = dx if multiplier == 1.0 else torch.empty_like(dx)
    else:
        dresidual = None
    _C.fused_residual_add_rmsnorm_backward(_d(grad_y), _d(grad_r), _d(saved), _d(weight), _d(rstd),
                                           _d(dx), _d(dresidual), _d(dweight),
                                           multiplier=multiplier, stream=_stream(saved))
    return dx, dresidual, dweight


# One op pair for both: rmsnorm is the fused op without residual and with multiplier 1. The op
# returns (y, r, rstd), r empty without a residual; its backward returns (dx, dresidual, dweight),
# dresidual empty when it is dx (a custom op's outputs may not alias).
@torch.library.custom_op("meshfuse::rmsnorm", mutates_args=())
def _rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float,
             multiplier: float) -> tuple[Tensor, Tensor, Tensor]:
    y, r, rstd = rmsnorm_forward(x, weight, eps, residual, multiplier)
    return y, _nothing(x) if r is None else r, rstd


@_fake(_rmsnorm)
def _(x, residual, weight, eps, multiplier):
    r = _nothing(x) if residual is None else _empty_like(x)
    return _empty_like(x), r, x.new_empty(_rows(x), dtype=_rstd_dtype(x.dtype))


@torch.library.custom_op("meshfuse::rmsnorm_backward", mutates_args=())
def _rmsnorm_backward(grad_y: Tensor, grad_r: Optional[Tensor], saved: Tensor,
                      weight: Optional[Tensor], rstd: Tensor, residual_given: bool,
                      multiplier: float, need_dweight: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dresidual, dweight = rmsnorm_backward(grad_y, saved, weight, rstd, residual_given,
                                              multiplier, grad_r, need_dweight)
    return (dx, _nothing(dx) if dresidual is None or dresidual is dx else dresidual,
            _nothing(dx) if dweight is None else dweight)


@_fake(_rmsnorm_backward)
def _(grad_y, grad_r, saved, weight, rstd, residual_given, multiplier, need_dweight):
    dresidual = (_empty_like(saved) if residual_given and multiplier != 1.0
                 else _nothing(saved))
    dweight = (torch.empty_like(weight) if weight is not None and need_dweight
               else _nothing(saved))
    return _empty_like(saved), dresidual, dweight


def _rmsnorm_setup(ctx, inputs, output):
    x, residual, weight, _, multiplier = inputs
    _, r, rstd = output
    ctx.residual_given = residual is not None
    ctx.multiplier = multiplier
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(r if ctx.residual_given else x, weight, rstd)


def _rmsnorm_grad(ctx, grad_y, grad_r, _):
    saved, weight, rstd = ctx.saved_tensors
    grad_r = grad_r.contiguous() if ctx.residual_given and grad_r is not None else None
    dx, dresidual, dweight = _rmsnorm_backward(
        grad_y.contiguous(), grad_r, saved, weight, rstd, ctx.residual_given, ctx.multiplier,
        weight is not None and ctx.needs_input_grad[2])
    if ctx.residual_given:
        dresidual = dx if ctx.multiplier == 1.0 else dresidual
    else:
        dresidual = None
    # By the flag, not by dweight's emptiness: a weight of 0 elements has an empty gradient.
    return dx, dresidual, dweight if weight is not None and ctx.needs_input_grad[2] else None, \
        None, None


_rmsnorm.register_autograd(_rmsnorm_grad, setup_context=_rmsnorm_setup)


def rmsnorm(x, weight=None, eps=None):
    """RMSNorm over the last dim (Zhang & Sennrich 2019, arXiv:1910.07467):
    ``torch.nn.functional.rms_norm(x, (H,), weight, eps)``, i.e.
    ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    x: (..., H); weight: (H,) or None; float32, float64, bfloat16 or float16 (16-bit computed in
    fp32), one dtype and device. eps None: PyTorch's default, the machine epsilon of fp32 for
    16-bit inputs, else of x's dtype. Returns a contiguous tensor like x. Raises
    ShapeMismatchError, InvalidArgumentError (ValueError: eps < 0), DTypeMismatchError
    (TypeError), DeviceMismatchError (RuntimeError); TypeError for a weight that is not a tensor
    (F.rms_norm's normalized_shape in its place). Spec: include/meshfuse/ops/rmsnorm.h."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"rmsnorm: x must be a tensor, got {type(x).__name__}")
    if weight is not None and not isinstance(weight, torch.Tensor):
        raise TypeError(f"rmsnorm: weight must be a tensor or None, got {type(weight).__name__} "
                        "(rmsnorm(x, weight, eps) normalises the last dim and takes no "
                        "normalized_shape, unlike torch.nn.functional.rms_norm)")
    if _untraced(x, weight):
        return rmsnorm_forward(x, weight, _eps(x, eps), save_rstd=False)[0]
    return _rmsnorm(x, None, weight, _eps(x, eps), 1.0)[0]


def fused_residual_add_rmsnorm(x, residual, weight=None, eps=None, multiplier=1.0):
    """``r = x * multiplier + residual; y = rmsnorm(r, weight, eps)`` in one pass; returns (y, r)
    (r: the residual stream of the next layer; an empty tensor when residual is None).

    x, residual: (..., H); weight (H,) or None; dtypes, eps and errors as :func:`rmsnorm`."""
    if _untraced(x, residual, weight):
        y, r, _ = rmsnorm_forward(x, weight, _eps(x, eps), residual, multiplier, save_rstd=False)
        return y, _nothing(x) if r is None else r
    y, r, _ = _rmsnorm(x, residual, weight, _eps(x, eps), multiplier)
    return y, r


# --- softmax -------------------------------------------------------------------------------------
def softmax_forward(x, *, logits_multiplier=1.0):
    """The raw kernel of :func:`softmax`."""
    if _T is not None:
        return _T.softmax(x, logits_multiplier)
    y = _empty_like(x)
    _C.softmax(_d(x), _d(y), logits_multiplier, _stream(x))
    return y


def softmax_backward(grad_y, y, *, logits_multiplier=1.0):
    """The raw backward of :func:`softmax`: grad_x from the forward's output y."""
    grad_x = _empty_like(y)
    _C.softmax_backward(_d(grad_y), _d(y), _d(grad_x), logits_multiplier=logits_multiplier,
                        stream=_stream(y))
    return grad_x


@torch.library.custom_op("meshfuse::softmax", mutates_args=())
def _softmax(x: Tensor, logits_multiplier: float) -> Tensor:
    return softmax_forward(x, logits_multiplier=logits_multiplier)


@_fake(_softmax)
def _(x, logits_multiplier):
    return _empty_like(x)


@torch.library.custom_op("meshfuse::softmax_backward", mutates_args=())
def _softmax_backward(grad_y: Tensor, y: Tensor, logits_multiplier: float) -> Tensor:
    return softmax_backward(grad_y, y, logits_multiplier=logits_multiplier)


@_fake(_softmax_backward)
def _(grad_y, y, logits_multiplier):
    return _empty_like(y)


def _softmax_setup(ctx, inputs, output):
    ctx.logits_multiplier = inputs[1]
    ctx.save_for_backward(output)


def _softmax_grad(ctx, grad_y):
    (y,) = ctx.saved_tensors
    return _softmax_backward(grad_y.contiguous(), y, ctx.logits_multiplier), None


_softmax.register_autograd(_softmax_grad, setup_context=_softmax_setup)


def softmax(x, dim=-1, *, dtype=None, logits_multiplier=1.0):
    """``torch.softmax(x * logits_multiplier, dim=-1, dtype=dtype)``.

    x: (..., V), float32, float64, bfloat16 or float16 (16-bit computed in fp32); dtype: as
    torch's, x is cast to it first (None: x's). ``dim`` is PyTorch's second argument and must
    name the last dim (-1 or x.dim() - 1), an int or an integer such as NumPy's: a positional
    multiplier would read as a dim. Returns a contiguous tensor like x; a row entirely -inf gives
    NaN, as PyTorch. Raises ValueError for another dim, InvalidArgumentError (ValueError),
    DTypeMismatchError (TypeError). Spec: include/meshfuse/ops/softmax.h."""
    d = dim if type(dim) is int else _integer_or_none(dim)
    if d != -1 and d != x.dim() - 1:
        raise ValueError(f"softmax: dim must be the last dim (-1 or {x.dim() - 1}) of x "
                         f"{tuple(x.shape)}, got {dim!r}")
    if dtype is not None:
        x = x.to(dtype)
    if _untraced(x):
        return softmax_forward(x, logits_multiplier=logits_multiplier)
    return _softmax(x, logits_multiplier)


def _integer_or_none(dim):
    # An integer of another type than int (NumPy's, a 0-d integer tensor) as an int; None for
    # what is no dim (2.0, True, "1").
    if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
        return None
    return operator.index(dim)


# --- cross_entropy -------------------------------------------------------------------------------
def _check_name(op, argument, value, names):
    # As torch's: the exact lower-case names (the C++ parser takes any case, and this module
    # compares the names as they are). Before the op, whose fake implementation (torch.compile)
    # would not see a bad name.
    if value not in names:
        raise _C.InvalidArgumentError(
            f"[invalid argument] {op}: {argument}: unknown name {value!r} (expected one of "
            f"{', '.join(names)})")


def _check_reduction(op, reduction):
    _check_name(op, "reduction", reduction, _REDUCTIONS)


def _check_label_check(op, label_check):
    _check_name(op, "label_check", label_check, _LABEL_CHECKS)


_REDUCTIONS = ("none", "mean", "sum")
_LABEL_CHECKS = ("raise", "device_assert")


def _loss_shape(n, reduction):
    return (n,) if reduction == "none" else ()


def _lse_dtype(dtype):
    # As cross_entropy_lse_dtype in C++: f32 for 16-bit logits, f64 for f32 and f64 ones.
    return torch.float32 if dtype in _SIXTEEN_BIT else torch.float64


def _dtype_option(op, name, dtype, value, default):
    """An output's dtype from the argument ``name``: ``default`` for None, else the inputs' dtype
    or float32 for 16-bit inputs (the kernels' outputs take no other, and their error would name
    the output rather than the argument)."""
    allowed = (dtype, torch.float32) if dtype in _SIXTEEN_BIT else (dtype,)
    if value is None or value in allowed:
        return value or default
    raise _C.DTypeMismatchError(
        f"[dtype mismatch] {op}: {name} must be None, the inputs' dtype ({dtype})"
        f"{' or torch.float32' if dtype in _SIXTEEN_BIT else ''}, got {value}")


def _loss_dtype(op, dtype, loss_dtype):
    return _dtype_option(op, "loss_dtype", dtype, loss_dtype, dtype)


def cross_entropy_forward(logits, labels, ignore_index=-100, reduction="mean",
                          label_smoothing=0.0, logits_multiplier=1.0, z_loss_scale=0.0,
                          loss_dtype=None, vocab_start=0, vocab_size=0, save_lse=True,
                          label_check="device_assert"):
    """The raw kernel of :func:`cross_entropy`: returns (loss, lse); loss is () for mean/sum and
    (N,) for none, in ``loss_dtype`` (the logits' dtype by default, or float32 for 16-bit
    logits); lse is f32 for 16-bit logits, f64 for f32 and f64 ones, or None when not
    ``save_lse`` (inference has no backward to save it for). ``vocab_size`` != 0: the logits are
    the columns ``[vocab_start, vocab_start + V)`` of a vocabulary of ``vocab_size`` classes (a
    shard; meshfuse/ops/cross_entropy.h says how shards combine). ``label_check`` as
    :func:`cross_entropy`'s, whose default ("device_assert") it shares (the _meshfuse binding's is
    "raise")."""
    loss_dtype = _loss_dtype("cross_entropy", logits.dtype, loss_dtype)
    if _T is not None:
        return _T.cross_entropy(logits, labels, ignore_index, reduction, label_smoothing,
                                logits_multiplier, z_loss_scale, loss_dtype == torch.float32,
                                vocab_start, vocab_size, save_lse, label_check)
    n = logits.shape[0]
    loss = torch.empty(_loss_shape(n, reduction), dtype=loss_dtype, device=logits.device)
    lse = torch.empty((n,), dtype=_lse_dtype(logits.dtype), device=logits.device) \
        if save_lse else None
    _C.cross_entropy(_d(logits), _d(labels), _d(loss), _d(lse), ignore_index, reduction,
                     label_smoothing, logits_multiplier, z_loss_scale, vocab_start, vocab_size,
                     label_check, _stream(logits))
    return loss, lse


def cross_entropy_backward(grad_loss, logits, labels, lse, ignore_index=-100, reduction="mean",
                           label_smoothing=0.0, logits_multiplier=1.0, z_loss_scale=0.0,
                           vocab_start=0, vocab_size=0, label_check="device_assert"):
    """The raw backward: grad_logits (N, V). grad_loss: the loss's shape, in the logits' dtype
    or float32 for 16-bit logits. For a shard (``vocab_start``, ``vocab_size`` as in
    :func:`cross_entropy_forward`), lse is the whole vocabulary's."""
    grad_logits = _empty_like(logits)
    _C.cross_entropy_backward(_d(grad_loss.contiguous()), _d(logits), _d(labels), _d(lse),
                              _d(grad_logits), ignore_index=ignore_index, reduction=reduction,
                              label_smoothing=label_smoothing,
                              logits_multiplier=logits_multiplier, z_loss_scale=z_loss_scale,
                              vocab_start=vocab_start, vocab_size=vocab_size,
                              label_check=label_check, stream=_stream(logits))
    return grad_logits


@torch.library.custom_op("meshfuse::cross_entropy", mutates_args=())
def _cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                   label_smoothing: float, logits_multiplier: float, z_loss_scale: float,
                   loss_dtype: Optional[torch.dtype],
                   label_check: str = "device_assert") -> tuple[Tensor, Tensor]:
    return cross_entropy_forward(logits, labels, ignore_index, reduction, label_smoothing,
                                 logits_multiplier, z_loss_scale, loss_dtype,
                                 label_check=label_check)


@_fake(_cross_entropy)
def _(logits, labels, ignore_index, reduction, label_smoothing, logits_multiplier,
      z_loss_scale, loss_dtype, label_check="device_assert"):
    n = logits.shape[0]
    return (logits.new_empty(_loss_shape(n, reduction),
                             dtype=_loss_dtype("cross_entropy", logits.dtype, loss_dtype)),
            logits.new_empty((n,), dtype=_lse_dtype(logits.dtype)))


@torch.library.custom_op("meshfuse::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(grad_loss: Tensor, logits: Tensor, labels: Tensor, lse: Tensor,
                            ignore_index: int, reduction: str, label_smoothing: float,
                            logits_multiplier: float, z_loss_scale: float,
                            label_check: str = "device_assert") -> Tensor:
    return cross_entropy_backward(grad_loss, logits, labels, lse, ignore_index, reduction,
                                  label_smoothing, logits_multiplier, z_loss_scale,
                                  label_check=label_check)


@_fake(_cross_entropy_backward)
def _(grad_loss, logits, labels, lse, *options):
    return _empty_like(logits)


def _cross_entropy_setup(ctx, inputs, output):
    logits, labels, *options = inputs
    ctx.options = options[:5] + options[6:]  # loss_dtype is not the backward's
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, labels, output[1])


def _cross_entropy_grad(ctx, grad_loss, _):
    logits, labels, lse = ctx.saved_tensors
    grad = _cross_entropy_backward(grad_loss, logits, labels, lse, *ctx.options)
    return grad, *[None] * 8


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


def cross_entropy(logits, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  logits_multiplier=1.0, z_loss_scale=0.0, loss_dtype=None, *,
                  label_check="device_assert"):
    """``torch.nn.functional.cross_entropy(logits * logits_multiplier, labels, ignore_index=,
    reduction=, label_smoothing=)`` plus PaLM's z-loss ``z_loss_scale * lse**2`` per row not
    ignored (Chowdhery et al. 2022, arXiv:2204.02311).

    logits (N, V) float32, float64, bfloat16 or float16; labels (N,) int32 or int64, in [0, V)
    or ignore_index. Returns the loss, () for mean and sum, (N,) for none. Its dtype is the
    logits', as PyTorch's, unless ``loss_dtype=torch.float32`` is given for 16-bit logits
    (Megatron-LM's fp32 loss: the per-row losses are summed in double and rounded once to it);
    the backward then takes an fp32 upstream gradient. Raises InvalidArgumentError (ValueError: a
    label out of range on the CPU, or on CUDA under label_check="raise"; label_smoothing outside
    [0, 1], an unknown reduction or label_check),
    ShapeMismatchError (ValueError), DTypeMismatchError (TypeError).

    ``label_check`` decides how a bad label fails on CUDA, where the labels live on the device:
    ``"device_assert"`` (the default: PyTorch's behaviour, no host round trip per call) does not
    wait: the kernel prints the message above for a bad row and traps, after which the process's
    CUDA context is unusable; ``"raise"`` (meshfuse's C++ default) waits on the host for the
    device's check, so that the call raises the error above with nothing written, at the cost of
    a host synchronisation per call. CUDA graph capture always gets the former. On the CPU both
    raise. Spec: include/meshfuse/ops/cross_entropy.h."""
    _check_reduction("cross_entropy", reduction)
    _check_label_check("cross_entropy", label_check)
    options = (ignore_index, reduction, label_smoothing, logits_multiplier, z_loss_scale,
               loss_dtype)
    if _untraced(logits, labels):
        return cross_entropy_forward(logits, labels, *options, save_lse=False,
                                     label_check=label_check)[0]
    return _cross_entropy(logits, labels, *options, label_check)[0]


# --- fused_linear_cross_entropy ------------------------------------------------------------------
def _wide(dtype):
    return torch.float32 if dtype in _SIXTEEN_BIT else dtype


def _accum_dtype(dtype, accum_dtype):
    # grad_weight's and grad_bias's dtype, which decides how the chunks' products add up (C++
    # fused_linear_cross_entropy.h): float32 for 16-bit inputs unless asked for theirs. Not
    # float16: its gradients are summed scaled by up to 2^15 (_gradient_scale), past its 65504.
    if dtype == torch.float16 and accum_dtype == torch.float16:
        raise _C.DTypeMismatchError(
            "[dtype mismatch] fused_linear_cross_entropy: accum_dtype must be None or "
            "torch.float32 for float16 inputs (their gradients are summed scaled by up to 2^15, "
            "which a float16 sum overflows), got torch.float16")
    return _dtype_option("fused_linear_cross_entropy", "accum_dtype", dtype, accum_dtype,
                         _wide(dtype))


def fused_linear_cross_entropy_forward(x, weight, labels, bias=None, grad_loss=None,
                                       grad_x=False, grad_weight=False, grad_bias=False,
                                       ignore_index=-100, reduction="mean", label_smoothing=0.0,
                                       logits_multiplier=1.0, z_loss_scale=0.0, loss_dtype=None,
                                       chunk_rows=0, accum_dtype=None, label_check="device_assert"):
    """The raw kernel: returns (loss, grad_x, grad_weight, grad_bias), each gradient None unless
    asked for (then grad_loss, in the loss's dtype, is required). grad_weight and grad_bias are
    in ``accum_dtype``: float32 for 16-bit inputs by default (one rounding at the end), or the
    inputs' dtype (one rounding per chunk); the loss is in ``loss_dtype`` (the inputs' dtype by
    default)."""
    if grad_bias and bias is None:
        raise ValueError("fused_linear_cross_entropy: grad_bias=True needs a bias")
    wide = _accum_dtype(x.dtype, accum_dtype)
    loss = torch.empty(_loss_shape(x.shape[0], reduction),
                       dtype=_loss_dtype("fused_linear_cross_entropy", x.dtype, loss_dtype),
                       device=x.device)
    dx = _empty_like(x) if grad_x else None
    dw = torch.empty(weight.shape, dtype=wide, device=x.device) if grad_weight else None
    db = torch.empty(bias.shape, dtype=wide, device=x.device) if grad_bias else None
    _C.fused_linear_cross_entropy(
        _d(x), _d(weight), _d(bias), _d(labels), _d(grad_loss), _d(loss), _d(dx), _d(dw), _d(db),
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        logits_multiplier=logits_multiplier, z_loss_scale=z_loss_scale, chunk_rows=chunk_rows,
        label_check=label_check, stream=_stream(x))
    return loss, dx, dw, db


# The op computes the gradients it is asked for with the loss. For mean and sum the caller asks
# with grad_loss 1 (a training framework's loss is the graph's output) and the backward scales
# them by the real upstream (they are linear in it): one pass over the logits for forward and
# backward. For none the upstream is per row: the forward computes the loss only and the backward
# runs the op again with it (the logits are recomputed; nothing of size N x V is kept).
@torch.library.custom_op("meshfuse::fused_linear_cross_entropy", mutates_args=())
def _fused_linear_cross_entropy(
        x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
        grad_loss: Optional[Tensor], grad_x: bool, grad_weight: bool, grad_bias: bool,
        ignore_index: int, reduction: str, label_smoothing: float, logits_multiplier: float,
        z_loss_scale: float, loss_dtype: Optional[torch.dtype], chunk_rows: int,
        accum_dtype: Optional[torch.dtype] = None,
        label_check: str = "device_assert") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    loss, *grads = fused_linear_cross_entropy_forward(
        x, weight, labels, bias, grad_loss, grad_x, grad_weight, grad_bias, ignore_index,
        reduction, label_smoothing, logits_multiplier, z_loss_scale, loss_dtype, chunk_rows,
        accum_dtype, label_check)
    return (loss, *[_nothing(x) if g is None else g for g in grads])


@_fake(_fused_linear_cross_entropy)
def _(x, weight, bias, labels, grad_loss, grad_x, grad_weight, grad_bias, ignore_index,
      reduction, label_smoothing, logits_multiplier, z_loss_scale, loss_dtype, chunk_rows,
      accum_dtype=None, label_check="device_assert"):
    wide = _accum_dtype(x.dtype, accum_dtype)
    loss = x.new_empty(_loss_shape(x.shape[0], reduction),
                       dtype=_loss_dtype("fused_linear_cross_entropy", x.dtype, loss_dtype))
    dx = _empty_like(x) if grad_x else _nothing(x)
    dw = x.new_empty(weight.shape, dtype=wide) if grad_weight else _nothing(x)
    db = x.new_empty(bias.shape, dtype=wide) if grad_bias else _nothing(x)
    return loss, dx, dw, db


def _flce_setup(ctx, inputs, output):
    x, weight, bias, labels, scale, *computed = inputs[:8]
    ctx.options = inputs[8:]
    ctx.computed = computed  # the gradients the forward computed (mean and sum)
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.mark_non_differentiable(*output[1:])
    # Else autograd passes the backward zeros for the (non-differentiable) gradient outputs, which
    # nothing reads: an fp32 weight-sized buffer (2 GiB at a 128256 x 4096 head) at the start of
    # the backward. The loss's gradient is the only one that reaches this node, never None.
    ctx.set_materialize_grads(False)
    if ctx.options[1] == "none":  # reduction
        ctx.save_for_backward(x, weight, bias, labels)
    else:
        ctx.save_for_backward(*output[1:], scale)  # what the gradients were computed with


def _flce_grad(ctx, grad_loss, *_):
    if ctx.options[1] == "none":
        x, weight, bias, labels = ctx.saved_tensors
        wants = [w and t is not None for w, t in zip(ctx.needs_input_grad, (x, weight, bias))]
        _, *grads = _fused_linear_cross_entropy(x, weight, bias, labels, grad_loss.contiguous(),
                                                *wants, *ctx.options)
    else:
        # Before saved_tensors, whose version check would raise torch's generic in-place error.
        if getattr(ctx, "scaled_in_place", False):
            raise RuntimeError(
                "meshfuse::fused_linear_cross_entropy: a second backward through the same "
                "forward: the first scaled the gradients the forward computed in place (so that "
                "a large head needs no second weight-sized buffer); run the forward again")
        wants, (*saved, scale) = ctx.computed, ctx.saved_tensors
        missing = [name for name, need, want in zip(("x", "weight", "bias"), ctx.needs_input_grad,
                                                    wants) if need and not want]
        if missing:  # the op called directly, asking for fewer than autograd needs
            raise RuntimeError(
                f"meshfuse::fused_linear_cross_entropy: autograd needs the gradient of "
                f"{', '.join(missing)}, which the forward did not compute (its grad_* flags); "
                f"meshfuse.torch.fused_linear_cross_entropy asks for every one autograd needs")
        # The real upstream over the forward's (_gradient_scale), in float32 at least: a float16
        # quotient of a small upstream by up to 2^15 rounds to a subnormal or to zero.
        wide = _wide(grad_loss.dtype)
        grad_loss = grad_loss.to(wide) / scale.to(wide)
        if all(type(g) is torch.Tensor for g in saved):
            # Eager: scaled in place, so that a large head needs no second weight-sized fp32
            # buffer. A second backward (retain_graph) is then refused (scaled_in_place).
            grads = [g.mul_(grad_loss) if want else None for g, want in zip(saved, wants)]
            ctx.scaled_in_place = True
        else:
            # Traced (torch.compile, opcheck): out of place, as AOTAutograd cannot trace an
            # in-place scaling of saved forward outputs.
            grads = [g * grad_loss if want else None for g, want in zip(saved, wants)]
    grads = [g.to(dtype) if want else None for g, want, dtype in zip(grads, wants, ctx.dtypes)]
    return (*grads, *[None] * 14)


_fused_linear_cross_entropy.register_autograd(_flce_grad, setup_context=_flce_setup)


def _gradient_scale(x, labels, ignore_index, reduction, dtype):
    # The upstream the forward computes the gradients with, divided out in the backward. For
    # float16 and mean it is 2^k <= the rows counted (at most 2^15, which float16 holds), so that
    # mean's 1/N does not round the small ones to zero in float16 before the real upstream (a
    # GradScaler's loss scale) reaches them; a power of two scales exactly. On the device: no sync.
    if x.dtype != torch.float16 or reduction != "mean":
        return torch.ones((), dtype=dtype, device=x.device)
    counted = (labels != ignore_index).sum().clamp(min=1).float()
    return torch.exp2(torch.floor(torch.log2(counted))).clamp(max=2.0 ** 15).to(dtype)


def fused_linear_cross_entropy(x, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, logits_multiplier=1.0, z_loss_scale=0.0,
                               loss_dtype=None, chunk_rows=0, accum_dtype=None, *,
                               label_check="device_assert"):
    """``cross_entropy(torch.nn.functional.linear(x, weight, bias), labels, ...)`` without the
    (N, V) logits in memory: the logits are made and consumed in chunks of rows (as Liger's and
    Apple's Cut Cross-Entropy, Wijmans et al. 2024, arXiv:2411.09009, avoid them).

    x (N, H); weight (V, H); bias (V,) or None: one dtype (float32, float64, bfloat16,
    float16); labels (N,) int32 or int64. Options, ``loss_dtype`` and ``label_check`` as
    :func:`cross_entropy`;
    ``chunk_rows`` 0 picks the device's default. For mean and sum, the gradients are computed in
    the forward (when autograd wants them) and scaled by the upstream in the backward; for float16
    and mean they are computed scaled by a power of two near the rows counted, so that a loss scale
    (GradScaler) keeps the small ones as it does for PyTorch's. The weight's and bias's are summed
    over the chunks in ``accum_dtype``: by default float32 for 16-bit inputs, rounded once at the
    backward (as PyTorch's unfused GEMM), which holds a float32 weight-sized buffer from the
    forward to the backward (V x H x 4 bytes); the inputs' dtype instead (as Liger-Kernel's
    default; bfloat16, float32 or float64, not float16) holds only the gradient itself, rounded
    once per chunk and once more by an upstream that is not a power of two. Errors as
    :func:`cross_entropy`; a bad ``accum_dtype`` is a DTypeMismatchError. Spec:
    include/meshfuse/ops/fused_linear_cross_entropy.h."""
    _check_reduction("fused_linear_cross_entropy", reduction)
    _check_label_check("fused_linear_cross_entropy", label_check)
    if _functorch_transforms() or _fwad._current_level >= 0:
        _refuse_forward_mode((x, weight, bias))
    # Under torch.no_grad() requires_grad still says True: no gradients then.
    grad = torch.is_grad_enabled() and reduction != "none"
    wants = [grad and t is not None and t.requires_grad for t in (x, weight, bias)]
    scale = _gradient_scale(x, labels, ignore_index, reduction,
                            loss_dtype or x.dtype) if any(wants) else None
    return _fused_linear_cross_entropy(x, weight, bias, labels, scale, *wants, ignore_index,
                                       reduction, label_smoothing, logits_multiplier,
                                       z_loss_scale, loss_dtype, chunk_rows, accum_dtype,
                                       label_check)[0]


# --- rnn and gru ---------------------------------------------------------------------------------
def _check_cu_seqlens(op, cu_seqlens):
    """The offsets' shape, checked before output shapes are taken from it (torch's errors of an
    empty or 2-D cu_seqlens named neither the op nor the argument)."""
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1):
        raise _C.ShapeMismatchError(f"[shape mismatch] {op}: cu_seqlens must be 1-D with B + 1 >= 1 "
                                    f"offsets, got shape {list(cu_seqlens.shape)}")


def _recurrent_shapes(op, inputs, weights, input_state, cu_seqlens):
    """(output shape, final_state shape): N = the largest head count (head broadcasting)."""
    _check_cu_seqlens(op, cu_seqlens)
    for name, t, dims in (("input", inputs[0], 2), ("weight", weights[0], 1)):
        if t.dim() < dims:  # the dims the shapes below read
            raise _C.ShapeMismatchError(f"[shape mismatch] {op}: {name} has too few dims, got "
                                        f"shape {list(t.shape)} (include/meshfuse/ops/recurrent.h)")
    heads = max([x.shape[-2] for x in inputs] + [w.shape[0] for w in weights] +
                ([] if input_state is None else [input_state.shape[1]]))
    x = inputs[0]
    batch = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    return (*x.shape[:-2], heads, x.shape[-1]), (batch, heads, x.shape[-1])


def _max_seqlen(max_seqlen):
    return -1 if max_seqlen is None else int(max_seqlen)


def rnn_forward(input, weight, input_state=None, cu_seqlens=None, max_seqlen=None):
    """Returns (output, final_state); see rnn()."""
    out_shape, state_shape = _recurrent_shapes("rnn", [input], [weight], input_state, cu_seqlens)
    output = input.new_empty(out_shape)
    final_state = input.new_empty(state_shape)
    _C.rnn(_d(input), _d(weight), _d(input_state), _d(output), _d(final_state),
           cu_seqlens=_d(cu_seqlens),
           max_seqlen=_max_seqlen(max_seqlen), stream=_stream(input))
    return output, final_state


def rnn_backward(grad_output, grad_final_state, output, input_shape, weight, input_state=None,
                 gradient_clipping=None, cu_seqlens=None, max_seqlen=None,
                 need_input_state_grad=True):
    """Returns (grad_input, grad_weight, grad_input_state or None); the upstream gradients may be
    None (zeros). input_shape: the forward input's shape (the kernel needs only the outputs)."""
    grad_input = output.new_empty(input_shape)
    grad_weight = _empty_like(weight)
    grad_input_state = (None if input_state is None or not need_input_state_grad
                        else _empty_like(input_state))
    _C.rnn_backward(_d(grad_output), _d(grad_final_state), _d(output), _d(weight),
                    _d(input_state), _d(grad_input), _d(grad_weight), _d(grad_input_state),
                    gradient_clipping=gradient_clipping, cu_seqlens=_d(cu_seqlens),
                    max_seqlen=_max_seqlen(max_seqlen), stream=_stream(output))
    return grad_input, grad_weight, grad_input_state


def gru_forward(input, weight, forget_input, forget_weight, reset_input, reset_weight,
                input_state=None, cu_seqlens=None, max_seqlen=None):
    """Returns (output, final_state); see gru()."""
    inputs, weights = [input, forget_input, reset_input], [weight, forget_weight, reset_weight]
    out_shape, state_shape = _recurrent_shapes("gru", inputs, weights, input_state, cu_seqlens)
    output = input.new_empty(out_shape)
    final_state = input.new_empty(state_shape)
    _C.gru(_d(input), _d(weight), _d(forget_input), _d(forget_weight), _d(reset_input),
           _d(reset_weight), _d(input_state), _d(output), _d(final_state),
           cu_seqlens=_d(cu_seqlens),
           max_seqlen=_max_seqlen(max_seqlen), stream=_stream(input))
    return output, final_state


def gru_backward(grad_output, grad_final_state, output, input, weight, forget_input,
                 forget_weight, reset_input, reset_weight, input_state=None,
                 gradient_clipping=None, cu_seqlens=None, max_seqlen=None,
                 need_input_state_grad=True):
    """Returns the gradients of (input, weight, forget_input, forget_weight, reset_input,
    reset_weight, input_state or None); the upstream gradients may be None (zeros)."""
    params = [input, weight, forget_input, forget_weight, reset_input, reset_weight]
    grads = [_empty_like(p) for p in params]
    grad_input_state = (None if input_state is None or not need_input_state_grad
                        else _empty_like(input_state))
    _C.gru_backward(_d(grad_output), _d(grad_final_state), _d(output), *[_d(p) for p in params],
                    _d(input_state), *[_d(g) for g in grads], _d(grad_input_state),
                    gradient_clipping=gradient_clipping, cu_seqlens=_d(cu_seqlens),
                    max_seqlen=_max_seqlen(max_seqlen), stream=_stream(output))
    return (*grads, grad_input_state)


# gradient_clipping changes only the backward; it is an argument of the forward op so that the
# autograd formula gets it. The upstream gradient of an output nobody used is None (zeros): the
# kernels take it as undefined.
@torch.library.custom_op("meshfuse::rnn", mutates_args=())
def _rnn(input: Tensor, weight: Tensor, input_state: Optional[Tensor],
         gradient_clipping: Optional[float], cu_seqlens: Optional[Tensor],
         max_seqlen: Optional[int]) -> tuple[Tensor, Tensor]:
    return rnn_forward(input, weight, input_state, cu_seqlens, max_seqlen)


@_fake(_rnn)
def _(input, weight, input_state, gradient_clipping, cu_seqlens, max_seqlen):
    out_shape, state_shape = _recurrent_shapes("rnn", [input], [weight], input_state, cu_seqlens)
    return input.new_empty(out_shape), input.new_empty(state_shape)


@torch.library.custom_op("meshfuse::rnn_backward", mutates_args=())
def _rnn_backward(grad_output: Optional[Tensor], grad_final_state: Optional[Tensor],
                  output: Tensor, input_shape: Sequence[int], weight: Tensor,
                  input_state: Optional[Tensor], gradient_clipping: Optional[float],
                  cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                  need_input_state_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    grad_input, grad_weight, grad_state = rnn_backward(
        grad_output, grad_final_state, output, input_shape, weight, input_state,
        gradient_clipping, cu_seqlens, max_seqlen, need_input_state_grad)
    return grad_input, grad_weight, _nothing(output) if grad_state is None else grad_state


@_fake(_rnn_backward)
def _(grad_output, grad_final_state, output, input_shape, weight, input_state,
      gradient_clipping, cu_seqlens, max_seqlen, need_input_state_grad):
    state = (_empty_like(input_state) if input_state is not None and need_input_state_grad
             else _nothing(output))
    return output.new_empty(input_shape), _empty_like(weight), state


def _rnn_setup(ctx, inputs, output):
    input, weight, input_state, gradient_clipping, cu_seqlens, max_seqlen = inputs
    ctx.save_for_backward(output[0], weight, input_state, cu_seqlens)
    ctx.input_shape, ctx.gradient_clipping, ctx.max_seqlen = (input.shape, gradient_clipping,
                                                              max_seqlen)


def _rnn_grad(ctx, grad_output, grad_final_state):
    output, weight, input_state, cu_seqlens = ctx.saved_tensors
    grads = _rnn_backward(grad_output, grad_final_state, output, ctx.input_shape, weight,
                          input_state, ctx.gradient_clipping, cu_seqlens, ctx.max_seqlen,
                          ctx.needs_input_grad[2])
    return grads[0], grads[1], grads[2] if ctx.needs_input_grad[2] else None, None, None, None


_rnn.register_autograd(_rnn_grad, setup_context=_rnn_setup)


def rnn(input, weight, input_state=None, gradient_clipping=None, cu_seqlens=None,
        max_seqlen=None):
    """Multi-head RNN, per head n: ``h_t = tanh(h_{t-1} @ weight[n] + input_t)`` (Elman 1990).

    input (B, S, N, H), or packed (T, N, H) with cu_seqlens (B+1,) int32/uint32/int64; weight
    (N, H, H); input_state (B, N, H) or None (zeros); float32, float64, bfloat16 or float16.
    Inputs and weights may have fewer heads than N when their count divides N (broadcast).
    gradient_clipping = c clamps the state's gradient to [-c, c] at every step of the backward.
    Returns (output like input with N heads, final_state (B, N, H)). Raises ShapeMismatchError,
    InvalidArgumentError (ValueError), DTypeMismatchError (TypeError). Spec:
    include/meshfuse/ops/recurrent.h."""
    _check_clipping("rnn", gradient_clipping)
    return _rnn(input, weight, input_state, gradient_clipping, cu_seqlens, max_seqlen)


def _check_clipping(op, gradient_clipping):
    # Only the backward uses it; checked here too, so that a bad value fails at the call.
    if gradient_clipping is not None and not gradient_clipping >= 0:
        raise _C.InvalidArgumentError(f"[invalid argument] {op}: gradient_clipping must be >= 0 "
                                      f"(or not given), got {gradient_clipping}")


@torch.library.custom_op("meshfuse::gru", mutates_args=())
def _gru(input: Tensor, weight: Tensor, forget_input: Tensor, forget_weight: Tensor,
         reset_input: Tensor, reset_weight: Tensor, input_state: Optional[Tensor],
         gradient_clipping: Optional[float], cu_seqlens: Optional[Tensor],
         max_seqlen: Optional[int]) -> tuple[Tensor, Tensor]:
    return gru_forward(input, weight, forget_input, forget_weight, reset_input, reset_weight,
                       input_state, cu_seqlens, max_seqlen)


@_fake(_gru)
def _(input, weight, forget_input, forget_weight, reset_input, reset_weight, input_state,
      gradient_clipping, cu_seqlens, max_seqlen):
    out_shape, state_shape = _recurrent_shapes("gru", [input, forget_input, reset_input],
                                               [weight, forget_weight, reset_weight],
                                               input_state, cu_seqlens)
    return input.new_empty(out_shape), input.new_empty(state_shape)


@torch.library.custom_op("meshfuse::gru_backward", mutates_args=())
def _gru_backward(grad_output: Optional[Tensor], grad_final_state: Optional[Tensor],
                  output: Tensor, input: Tensor, weight: Tensor, forget_input: Tensor,
                  forget_weight: Tensor, reset_input: Tensor, reset_weight: Tensor,
                  input_state: Optional[Tensor], gradient_clipping: Optional[float],
                  cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                  need_input_state_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                         Tensor, Tensor]:
    *grads, grad_state = gru_backward(
        grad_output, grad_final_state, output, input, weight, forget_input, forget_weight,
        reset_input, reset_weight, input_state, gradient_clipping, cu_seqlens, max_seqlen,
        need_input_state_grad)
    return (*grads, _nothing(output) if grad_state is None else grad_state)


@_fake(_gru_backward)
def _(grad_output, grad_final_state, output, *params_and_options):
    params, (input_state, _, _, _, need_input_state_grad) = (params_and_options[:6],
                                                              params_and_options[6:])
    state = (_empty_like(input_state) if input_state is not None and need_input_state_grad
             else _nothing(output))
    return (*[_empty_like(p) for p in params], state)


def _gru_setup(ctx, inputs, output):
    *params, input_state, gradient_clipping, cu_seqlens, max_seqlen = inputs
    ctx.save_for_backward(output[0], *params, input_state, cu_seqlens)
    ctx.gradient_clipping, ctx.max_seqlen = gradient_clipping, max_seqlen


def _gru_grad(ctx, grad_output, grad_final_state):
    output, *params, input_state, cu_seqlens = ctx.saved_tensors
    *grads, grad_state = _gru_backward(grad_output, grad_final_state, output, *params,
                                       input_state, ctx.gradient_clipping, cu_seqlens,
                                       ctx.max_seqlen, ctx.needs_input_grad[6])
    return (*grads, grad_state if ctx.needs_input_grad[6] else None, None, None, None)


_gru.register_autograd(_gru_grad, setup_context=_gru_setup)


def gru(input, weight, forget_input, forget_weight, reset_input, reset_weight, input_state=None,
        gradient_clipping=None, cu_seqlens=None, max_seqlen=None):
    """Multi-head GRU (Cho et al. 2014, arXiv:1406.1078, row-vector form), per head n and step:
    ``f = sigmoid(h @ forget_weight[n] + forget_input_t)``,
    ``r = sigmoid(h @ reset_weight[n] + reset_input_t)``,
    ``z = tanh((h * r) @ weight[n] + input_t)``, ``h = f * h + (1 - f) * z``.
    Shapes, dtypes, head broadcasting, packing, gradient_clipping and errors as :func:`rnn`;
    returns (output, final_state)."""
    _check_clipping("gru", gradient_clipping)
    return _gru(input, weight, forget_input, forget_weight, reset_input, reset_weight,
                input_state, gradient_clipping, cu_seqlens, max_seqlen)


# --- pack_sequence, unpack_sequence, continuous_count -------------------------------------------
def pack_sequence_forward(x, cu_seqlens, padding_side="left"):
    """The raw kernel of :func:`pack_sequence`."""
    out = x.new_empty((int(cu_seqlens[-1]), *x.shape[2:]))
    _C.pack_sequence(_d(x), _d(cu_seqlens), _d(out), padding_side=padding_side, stream=_stream(x))
    return out


def unpack_sequence_forward(x, cu_seqlens, batch_size, sequence_length, padding_side="left"):
    """The raw kernel of :func:`unpack_sequence`."""
    out = x.new_empty((batch_size, sequence_length, *x.shape[1:]))
    _C.unpack_sequence(_d(x), _d(cu_seqlens), _d(out), padding_side=padding_side, stream=_stream(x))
    return out


@torch.library.custom_op("meshfuse::pack_sequence", mutates_args=())
def _pack_sequence(x: Tensor, cu_seqlens: Tensor, padding_side: str) -> Tensor:
    return pack_sequence_forward(x, cu_seqlens, padding_side)


@_fake(_pack_sequence)
def _(x, cu_seqlens, padding_side):
    # The token count is cu_seqlens[-1], a value of the data: a dynamic size to the compiler.
    tokens = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((tokens, *x.shape[2:]))


@torch.library.custom_op("meshfuse::unpack_sequence", mutates_args=())
def _unpack_sequence(x: Tensor, cu_seqlens: Tensor, batch_size: int, sequence_length: int,
                     padding_side: str) -> Tensor:
    return unpack_sequence_forward(x, cu_seqlens, batch_size, sequence_length, padding_side)


@_fake(_unpack_sequence)
def _(x, cu_seqlens, batch_size, sequence_length, padding_side):
    return x.new_empty((batch_size, sequence_length, *x.shape[1:]))


# Each is the other's backward.
def _pack_setup(ctx, inputs, output):
    x, cu_seqlens, ctx.padding_side = inputs
    ctx.shape = x.shape[:2]
    ctx.save_for_backward(cu_seqlens)


def _pack_grad(ctx, grad):
    (cu_seqlens,) = ctx.saved_tensors
    return _unpack_sequence(grad, cu_seqlens, *ctx.shape, ctx.padding_side), None, None


def _unpack_setup(ctx, inputs, output):
    ctx.padding_side = inputs[4]
    ctx.save_for_backward(inputs[1])


def _unpack_grad(ctx, grad):
    (cu_seqlens,) = ctx.saved_tensors
    return _pack_sequence(grad, cu_seqlens, ctx.padding_side), None, None, None, None


_pack_sequence.register_autograd(_pack_grad, setup_context=_pack_setup)
_unpack_sequence.register_autograd(_unpack_grad, setup_context=_unpack_setup)


def pack_sequence(x, cu_seqlens, padding_side="left"):
    """(B, S, ...) -> (T, ...): the tokens of each padded row, sequence after sequence, as
    cu_seqlens (B+1,) int32/uint32/int64 gives them ('left': the tokens sit at the end of each
    row; T = cu_seqlens[-1]). Any dtype; the backward is unpack_sequence. Raises
    InvalidArgumentError (ValueError: cu_seqlens not increasing, a sequence longer than S),
    ShapeMismatchError. Spec: include/meshfuse/ops/pack_sequence.h."""
    _check_cu_seqlens("pack_sequence", cu_seqlens)
    return _pack_sequence(x, cu_seqlens, padding_side)


def unpack_sequence(x, cu_seqlens, batch_size, sequence_length, padding_side="left"):
    """(T, ...) -> (batch_size, sequence_length, ...), the padding zero-filled; the inverse of
    :func:`pack_sequence`, whose forward is its backward. Errors as pack_sequence."""
    _check_cu_seqlens("unpack_sequence", cu_seqlens)
    if batch_size < 0 or sequence_length < 0:
        raise _C.InvalidArgumentError(f"[invalid argument] unpack_sequence: batch_size and "
                                      f"sequence_length must be >= 0, got {batch_size} and "
                                      f"{sequence_length}")
    return _unpack_sequence(x, cu_seqlens, batch_size, sequence_length, padding_side)


@torch.library.custom_op("meshfuse::continuous_count", mutates_args=())
def _continuous_count(x: Tensor, bins: int) -> Tensor:
    out = torch.empty(bins, dtype=torch.int64, device=x.device)
    _C.continuous_count(_d(x), _d(out), stream=_stream(x))
    return out


@_fake(_continuous_count)
def _(x, bins):
    return x.new_empty(bins, dtype=torch.int64)


def continuous_count(x, bins):
    """int64 counts (bins,) of each value of the 1-D int32/int64 x in [0, bins); values outside
    are ignored (``torch.bincount(x, minlength=bins)`` when all are in range). No gradient.
    Raises DTypeMismatchError (TypeError), InvalidArgumentError (ValueError: x not 1-D, bins < 0).
    Spec: include/meshfuse/ops/continuous_count.h."""
    if bins < 0:
        raise _C.InvalidArgumentError(f"[invalid argument] continuous_count: bins must be >= 0, "
                                      f"got {bins}")
    return _continuous_count(x, bins)


# --- modules -------------------------------------------------------------------------------------
class RMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` on meshfuse's kernel: the same arguments, parameters and state dict.
    The weight's dtype must be the input's (torch also takes a float32 weight for 16-bit input,
    off its fused kernel; meshfuse raises DTypeMismatchError).

    normalized_shape: int or the trailing shape to normalise over (several trailing dims are
    flattened into one row); eps None: PyTorch's default (see :func:`rmsnorm`);
    elementwise_affine: a learnable ``weight`` of normalized_shape, initialised to ones (by
    ``reset_parameters``, as torch's, for modules built on the meta device)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(
                torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x):
        dims = len(self.normalized_shape)
        if tuple(x.shape[-dims:]) != self.normalized_shape:
            raise ValueError(f"RMSNorm: expected the input's trailing shape "
                             f"{list(self.normalized_shape)}, got {list(x.shape)}")
        if dims == 1:
            return rmsnorm(x, self.weight, self.eps)
        weight = None if self.weight is None else self.weight.reshape(-1)
        # The row length named: reshape cannot infer -1 for an input of no elements.
        rows = x.reshape(*x.shape[:-dims], math.prod(self.normalized_shape))
        return rmsnorm(rows, weight, self.eps).reshape(x.shape)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


def swiglu_mlp(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None,
               down_bias=None):
    """The SwiGLU feed-forward block of Llama, Mistral and Qwen2:
    ``F.linear(swiglu(F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)),
    down_weight, down_bias)``. x (..., H); gate_weight, up_weight (I, H); down_weight (H, I).

    In eager autograd the activation's backward writes its gradients over the (..., I)
    projections gate and up, which nothing else holds: no allocation there (Liger's trick).
    Backpropagating twice through one graph (retain_graph) raises RuntimeError; a backward with
    create_graph takes separate outputs. Compiled graphs take :func:`swiglu` and plan their own
    memory."""
    gate = torch.nn.functional.linear(x, gate_weight, gate_bias)
    up = torch.nn.functional.linear(x, up_weight, up_bias)
    return torch.nn.functional.linear(_mlp_activation(gate, up, True), down_weight, down_bias)


def _mlp_activation(gate, up, sole_holder):
    # swiglu(gate, up) in an MLP; where the caller is the sole holder of gate and up, eager
    # autograd's backward writes its gradients over them (swiglu_mlp's docstring).
    if not sole_holder or _untraced(gate, up) or _is_compiling():
        return swiglu(gate, up)
    return _swiglu_reusing_inputs(gate, up)


def _plain_linear(module):
    # A torch.nn.Linear itself, without hooks of its own or global ones (which may keep its
    # output): what its forward returns is F.linear of its weight, and nothing else holds it.
    # LoRA adapters, quantised linears and hooks differ.
    return type(module) is torch.nn.Linear and not module._forward_hooks and \
        not module._forward_pre_hooks and not _global_forward_hooks and \
        not _global_forward_pre_hooks


_global_forward_hooks = torch.nn.modules.module._global_forward_hooks
_global_forward_pre_hooks = torch.nn.modules.module._global_forward_pre_hooks


def mlp_forward(mlp, x):
    """The SwiGLU feed-forward block of a module with Llama's ``gate_proj``, ``up_proj`` and
    ``down_proj``: ``down_proj(swiglu(gate_proj(x), up_proj(x)))``. The projections are called,
    so LoRA adapters, quantised linears and hooks on them take part; the activation reuses the
    projections' memory (as :func:`swiglu_mlp`) only where both are plain ``torch.nn.Linear``
    without hooks."""
    sole_holder = _plain_linear(mlp.gate_proj) and _plain_linear(mlp.up_proj)
    return mlp.down_proj(_mlp_activation(mlp.gate_proj(x), mlp.up_proj(x), sole_holder))


class SwiGLUMLP(torch.nn.Module):
    """The SwiGLU feed-forward block (:func:`swiglu_mlp`) with Hugging Face's Llama MLP parameter
    names (``gate_proj``, ``up_proj``, ``down_proj``, ``torch.nn.Linear`` each), so a Llama
    MLP's state dict loads as it is; forward is :func:`mlp_forward` (adapters and hooks on the
    projections take part)."""

    def __init__(self, hidden_size, intermediate_size, bias=False, device=None, dtype=None):
        super().__init__()
        options = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **options)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **options)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **options)

    def forward(self, x):
        return mlp_forward(self, x)


def _no_class_weights(weight):
    if weight is not None:
        raise NotImplementedError("meshfuse's cross-entropy has no class weights (weight=None)")


class CrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss`` on meshfuse's kernel (:func:`cross_entropy`), with its
    arguments in its order (class weights are not supported: weight must be None; the deprecated
    size_average and reduce set the reduction, as torch's) and meshfuse's ``logits_multiplier``,
    ``z_loss_scale``, ``loss_dtype`` and ``label_check``. forward(input (N, V), target (N,)).
    Raises ValueError for a reduction other than "none", "mean" and "sum" or a label_check other
    than "raise" and "device_assert", NotImplementedError for class weights."""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None,
                 reduction="mean", label_smoothing=0.0, *, logits_multiplier=1.0,
                 z_loss_scale=0.0, loss_dtype=None, label_check="device_assert"):
        super().__init__()
        _no_class_weights(weight)
        if size_average is not None or reduce is not None:
            reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
        _check_reduction(type(self).__name__, reduction)
        _check_label_check(type(self).__name__, label_check)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.logits_multiplier = label_smoothing, logits_multiplier
        self.z_loss_scale, self.loss_dtype = z_loss_scale, loss_dtype
        self.label_check = label_check

    def forward(self, input, target):
        return cross_entropy(input, target, self.ignore_index, self.reduction,
                             self.label_smoothing, self.logits_multiplier, self.z_loss_scale,
                             self.loss_dtype, label_check=self.label_check)


class FusedLinearCrossEntropyLoss(CrossEntropyLoss):
    """The cross-entropy of a linear layer's output without the logits in memory
    (:func:`fused_linear_cross_entropy`): forward(input (N, H), weight (V, H), target (N,),
    bias=None) equals ``CrossEntropyLoss(...)(F.linear(input, weight, bias), target)``. Arguments
    as :class:`CrossEntropyLoss`, plus ``chunk_rows`` (0: the device's default) and
    ``accum_dtype`` (:func:`fused_linear_cross_entropy`)."""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None,
                 reduction="mean", label_smoothing=0.0, *, logits_multiplier=1.0,
                 z_loss_scale=0.0, loss_dtype=None, chunk_rows=0, accum_dtype=None,
                 label_check="device_assert"):
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing,
                         logits_multiplier=logits_multiplier, z_loss_scale=z_loss_scale,
                         loss_dtype=loss_dtype, label_check=label_check)
        self.chunk_rows, self.accum_dtype = chunk_rows, accum_dtype

    def forward(self, input, weight, target, bias=None):
        return fused_linear_cross_entropy(input, weight, target, bias, self.ignore_index,
                                          self.reduction, self.label_smoothing,
                                          self.logits_multiplier, self.z_loss_scale,
                                          self.loss_dtype, self.chunk_rows, self.accum_dtype,
                                          label_check=self.label_check)


def patch(model, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, *,
          accum_dtype=None):
    """Puts meshfuse's RMSNorm, SwiGLU MLP and fused linear cross-entropy loss into a Hugging Face
    transformers Llama, Mistral, Qwen2 or Mixtral model, in place; returns the model. See
    :mod:`meshfuse.hf` for what is swapped and how."""
    from .hf import patch as hf_patch  # imports this module: resolved at the call

    return hf_patch(model, rms_norm, swiglu, fused_linear_cross_entropy, accum_dtype=accum_dtype)
