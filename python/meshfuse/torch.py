"""PyTorch adapter: meshfuse ops as differentiable torch functions.

Each function allocates its outputs with torch, runs on the current CUDA stream of the inputs'
device (or the CPU), and has a ``torch.autograd.Function`` whose backward calls meshfuse's
backward kernel. The ``*_forward`` / ``*_backward`` pairs are the raw kernels (no autograd), for
benchmarks and custom training loops. Semantics follow ``torch.nn.functional``; shapes, dtypes and
errors are documented in include/meshfuse/ops/*.h.
"""

import math

import torch

from . import _meshfuse as _C


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _d(t):
    # DLPack refuses tensors that require grad; the kernels never record autograd history.
    return None if t is None else t.detach()


def _rows(x):
    # The rows of a row-wise op: every dim but the last (as detail::leading_rows in C++).
    return math.prod(x.shape[:-1])


# --- swiglu ----------------------------------------------------------------------------------
def swiglu_forward(gate, up):
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    _C.swiglu(_d(gate), _d(up), out, stream=_stream(gate))
    return out


def swiglu_backward(grad_out, gate, up):
    grad_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    grad_up = torch.empty_like(up, memory_format=torch.contiguous_format)
    _C.swiglu_backward(_d(grad_out), _d(gate), _d(up), grad_gate, grad_up, stream=_stream(gate))
    return grad_gate, grad_up


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        return swiglu_backward(grad_out.contiguous(), gate, up)


def swiglu(gate, up):
    """``up * silu(gate)`` (Shazeer 2020); gate, up: (..., I), same dtype and device."""
    return _Swiglu.apply(gate, up)


# --- rmsnorm and fused residual-add rmsnorm ----------------------------------------------------
def rmsnorm_forward(x, weight, eps, residual=None, multiplier=1.0):
    """Returns (y, r or None, rstd); r = x * multiplier + residual when a residual is given."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = torch.empty(_rows(x), dtype=torch.float32, device=x.device)
    if residual is None and multiplier == 1.0:
        _C.rmsnorm(_d(x), _d(weight), y, rstd, eps, stream=_stream(x))
        return y, None, rstd
    r = None if residual is None else torch.empty_like(y)
    _C.fused_residual_add_rmsnorm(_d(x), _d(residual), _d(weight), y, r, rstd, eps,
                                  multiplier=multiplier, stream=_stream(x))
    return y, r, rstd


def rmsnorm_backward(grad_y, saved, weight, rstd, residual_given, multiplier=1.0, grad_r=None):
    """saved: r when a residual was given, else x. Returns (dx, dresidual or None, dweight)."""
    dx = torch.empty_like(saved, memory_format=torch.contiguous_format)
    dweight = None if weight is None else torch.empty_like(weight)
    if not residual_given and multiplier == 1.0:
        _C.rmsnorm_backward(_d(grad_y), _d(saved), _d(weight), rstd, dx, dweight,
                            stream=_stream(saved))
        return dx, None, dweight
    dresidual = torch.empty_like(dx) if residual_given else None
    _C.fused_residual_add_rmsnorm_backward(_d(grad_y), _d(grad_r), _d(saved), _d(weight), rstd,
                                           dx, dresidual, dweight, multiplier=multiplier,
                                           stream=_stream(saved))
    return dx, dresidual, dweight


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, multiplier):
        y, r, rstd = rmsnorm_forward(x, weight, eps, residual, multiplier)
        ctx.residual_given = residual is not None
        ctx.multiplier = multiplier
        ctx.save_for_backward(r if r is not None else x, weight, rstd)
        return (y, r) if r is not None else (y, y.new_empty(0))

    @staticmethod
    def backward(ctx, grad_y, grad_r):
        saved, weight, rstd = ctx.saved_tensors
        grad_r = grad_r.contiguous() if ctx.residual_given else None
        dx, dresidual, dweight = rmsnorm_backward(grad_y.contiguous(), saved, weight, rstd,
                                                  ctx.residual_given, ctx.multiplier, grad_r)
        return dx, dresidual, dweight, None, None


def rmsnorm(x, weight=None, eps=1e-6):
    """``torch.nn.functional.rms_norm(x, (H,), weight, eps)`` over the last dim."""
    return _RmsNorm.apply(x, None, weight, eps, 1.0)[0]


def fused_residual_add_rmsnorm(x, residual, weight=None, eps=1e-6, multiplier=1.0):
    """Returns (y, r): r = x * multiplier + residual, y = rmsnorm(r) * weight."""
    return _RmsNorm.apply(x, residual, weight, eps, multiplier)


# --- softmax -------------------------------------------------------------------------------------
def softmax_forward(x, logits_multiplier=1.0):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _C.softmax(_d(x), y, logits_multiplier=logits_multiplier, stream=_stream(x))
    return y


def softmax_backward(grad_y, y, logits_multiplier=1.0):
    grad_x = torch.empty_like(y, memory_format=torch.contiguous_format)
    _C.softmax_backward(_d(grad_y), _d(y), grad_x, logits_multiplier=logits_multiplier,
                        stream=_stream(y))
    return grad_x


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, logits_multiplier):
        y = softmax_forward(x, logits_multiplier)
        ctx.logits_multiplier = logits_multiplier
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (y,) = ctx.saved_tensors
        return softmax_backward(grad_y.contiguous(), y, ctx.logits_multiplier), None


def softmax(x, logits_multiplier=1.0):
    """``torch.softmax(x * logits_multiplier, dim=-1)``."""
    return _Softmax.apply(x, logits_multiplier)


# --- cross_entropy -------------------------------------------------------------------------------
def cross_entropy_forward(logits, labels, ignore_index=-100, reduction="mean",
                          label_smoothing=0.0, logits_multiplier=1.0, z_loss_scale=0.0):
    """Returns (loss, lse); loss is () for mean/sum and (N,) for none, in the logits' dtype; lse
    is f32 (f64 for f64 logits)."""
    n = logits.shape[0]
    loss = torch.empty((n,) if reduction == "none" else (), dtype=logits.dtype,
                       device=logits.device)
    lse_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lse = torch.empty((n,), dtype=lse_dtype, device=logits.device)
    _C.cross_entropy(_d(logits), _d(labels), loss, lse, ignore_index=ignore_index,
                     reduction=reduction, label_smoothing=label_smoothing,
                     logits_multiplier=logits_multiplier, z_loss_scale=z_loss_scale,
                     stream=_stream(logits))
    return loss, lse


def cross_entropy_backward(grad_loss, logits, labels, lse, ignore_index=-100, reduction="mean",
                           label_smoothing=0.0, logits_multiplier=1.0, z_loss_scale=0.0):
    grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _C.cross_entropy_backward(_d(grad_loss).contiguous(), _d(logits), _d(labels), lse,
                              grad_logits, ignore_index=ignore_index, reduction=reduction,
                              label_smoothing=label_smoothing,
                              logits_multiplier=logits_multiplier, z_loss_scale=z_loss_scale,
                              stream=_stream(logits))
    return grad_logits


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, options):
        loss, lse = cross_entropy_forward(logits, labels, **options)
        ctx.options = options
        ctx.save_for_backward(logits, labels, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse = ctx.saved_tensors
        return cross_entropy_backward(grad_loss, logits, labels, lse, **ctx.options), None, None


def cross_entropy(logits, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  logits_multiplier=1.0, z_loss_scale=0.0):
    """``torch.nn.functional.cross_entropy(logits * logits_multiplier, labels, ...)`` plus an
    optional z-loss ``z_loss_scale * lse**2`` per row not ignored; logits (N, V), labels (N,)."""
    options = dict(ignore_index=ignore_index, reduction=reduction,
                   label_smoothing=label_smoothing, logits_multiplier=logits_multiplier,
                   z_loss_scale=z_loss_scale)
    return _CrossEntropy.apply(logits, labels, options)
