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
    """saved: r when a residual was given, else x. Returns (dx, dresidual or None, dweight);
    with a residual and multiplier 1, dresidual is dx itself (the same tensor)."""
    dx = torch.empty_like(saved, memory_format=torch.contiguous_format)
    dweight = None if weight is None else torch.empty_like(weight)
    if not residual_given and multiplier == 1.0:
        _C.rmsnorm_backward(_d(grad_y), _d(saved), _d(weight), rstd, dx, dweight,
                            stream=_stream(saved))
        return dx, None, dweight
    # With multiplier 1 the residual's gradient equals dx: dx itself is passed as dresidual and
    # written once, and returned for both (as torch's add backward gives both inputs one tensor).
    if residual_given:
        dresidual = dx if multiplier == 1.0 else torch.empty_like(dx)
    else:
        dresidual = None
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
def _loss_shape(n, reduction):
    return (n,) if reduction == "none" else ()


def cross_entropy_forward(logits, labels, ignore_index=-100, reduction="mean",
                          label_smoothing=0.0, logits_multiplier=1.0, z_loss_scale=0.0,
                          loss_dtype=None, vocab_start=0, vocab_size=0):
    """Returns (loss, lse); loss is () for mean/sum and (N,) for none, in ``loss_dtype`` (the
    logits' dtype by default, or float32 for 16-bit logits); lse is f32 for 16-bit logits, f64
    for f32 and f64 ones. ``vocab_size`` != 0: the logits are the columns
    ``[vocab_start, vocab_start + V)`` of a vocabulary of ``vocab_size`` classes (a shard;
    meshfuse/ops/cross_entropy.h says how shards combine)."""
    n = logits.shape[0]
    loss = torch.empty(_loss_shape(n, reduction), dtype=loss_dtype or logits.dtype,
                       device=logits.device)
    sixteen_bit = logits.dtype in (torch.bfloat16, torch.float16)
    lse_dtype = torch.float32 if sixteen_bit else torch.float64
    lse = torch.empty((n,), dtype=lse_dtype, device=logits.device)
    _C.cross_entropy(_d(logits), _d(labels), loss, lse, ignore_index=ignore_index,
                     reduction=reduction, label_smoothing=label_smoothing,
                     logits_multiplier=logits_multiplier, z_loss_scale=z_loss_scale,
                     vocab_start=vocab_start, vocab_size=vocab_size, stream=_stream(logits))
    return loss, lse


def cross_entropy_backward(grad_loss, logits, labels, lse, ignore_index=-100, reduction="mean",
                           label_smoothing=0.0, logits_multiplier=1.0, z_loss_scale=0.0,
                           vocab_start=0, vocab_size=0):
    """grad_loss: the loss's shape, in the logits' dtype or float32 for 16-bit logits. For a
    shard (``vocab_start``, ``vocab_size`` as in :func:`cross_entropy_forward`), lse is the whole
    vocabulary's."""
    grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _C.cross_entropy_backward(_d(grad_loss).contiguous(), _d(logits), _d(labels), lse,
                              grad_logits, ignore_index=ignore_index, reduction=reduction,
                              label_smoothing=label_smoothing,
                              logits_multiplier=logits_multiplier, z_loss_scale=z_loss_scale,
                              vocab_start=vocab_start, vocab_size=vocab_size,
                              stream=_stream(logits))
    return grad_logits


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, options, loss_dtype):
        loss, lse = cross_entropy_forward(logits, labels, **options, loss_dtype=loss_dtype)
        ctx.options = options
        ctx.save_for_backward(logits, labels, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse = ctx.saved_tensors
        grad = cross_entropy_backward(grad_loss, logits, labels, lse, **ctx.options)
        return grad, None, None, None


def cross_entropy(logits, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  logits_multiplier=1.0, z_loss_scale=0.0, loss_dtype=None):
    """``torch.nn.functional.cross_entropy(logits * logits_multiplier, labels, ...)`` plus an
    optional z-loss ``z_loss_scale * lse**2`` per row not ignored; logits (N, V), labels (N,).
    The loss has the logits' dtype, as PyTorch's, unless ``loss_dtype=torch.float32`` is given for
    16-bit logits (Megatron-LM's fp32 loss: the per-row losses are summed in double and rounded
    once to it)."""
    options = dict(ignore_index=ignore_index, reduction=reduction,
                   label_smoothing=label_smoothing, logits_multiplier=logits_multiplier,
                   z_loss_scale=z_loss_scale)
    return _CrossEntropy.apply(logits, labels, options, loss_dtype)


# --- fused_linear_cross_entropy ------------------------------------------------------------------
def fused_linear_cross_entropy_forward(x, weight, labels, bias=None, grad_loss=None,
                                       grad_x=False, grad_weight=False, grad_bias=False,
                                       ignore_index=-100, reduction="mean", label_smoothing=0.0,
                                       logits_multiplier=1.0, z_loss_scale=0.0, loss_dtype=None,
                                       chunk_rows=0):
    """The raw kernel: returns (loss, grad_x, grad_weight, grad_bias), each gradient None unless
    asked for (then grad_loss, in the loss's dtype, is required). grad_weight and grad_bias are
    float32 for 16-bit inputs (one rounding at the end instead of one per chunk), else the
    inputs' dtype; the loss is in ``loss_dtype`` (the inputs' dtype by default)."""
    if grad_bias and bias is None:
        raise ValueError("fused_linear_cross_entropy: grad_bias=True needs a bias")
    wide = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    loss = torch.empty(_loss_shape(x.shape[0], reduction), dtype=loss_dtype or x.dtype,
                       device=x.device)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if grad_x else None
    dw = torch.empty(weight.shape, dtype=wide, device=x.device) if grad_weight else None
    db = torch.empty(bias.shape, dtype=wide, device=x.device) if grad_bias else None
    _C.fused_linear_cross_entropy(
        _d(x), _d(weight), _d(bias), _d(labels), _d(grad_loss), loss, dx, dw, db,
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        logits_multiplier=logits_multiplier, z_loss_scale=z_loss_scale, chunk_rows=chunk_rows,
        stream=_stream(x))
    return loss, dx, dw, db


class _FusedLinearCrossEntropy(torch.autograd.Function):
    # mean and sum: the gradients are computed with the loss (upstream 1) and scaled in place by
    # the real upstream in backward (they are linear in it), so backward runs once per forward.
    # A 16-bit grad_x is then rounded twice (at upstream 1, and after the scaling) unless the
    # upstream is a power of two. none: the upstream is per row, so backward runs the op again
    # with it (the logits are recomputed; nothing of size N x V is kept).
    @staticmethod
    def forward(ctx, x, weight, bias, labels, options, grad_enabled):
        ctx.options = options
        # needs_input_grad says requires_grad even under torch.no_grad(): no gradients then.
        ctx.wants = tuple(w and grad_enabled for w in ctx.needs_input_grad[:3])
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        eager = options["reduction"] != "none" and any(ctx.wants)
        one = (torch.ones((), dtype=options["loss_dtype"] or x.dtype, device=x.device)
               if eager else None)
        loss, *ctx.grads = fused_linear_cross_entropy_forward(
            x, weight, labels, bias, one, *(ctx.wants if eager else (False,) * 3), **options)
        if not eager:
            ctx.save_for_backward(x, weight, bias, labels)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.options["reduction"] == "none":
            x, weight, bias, labels = ctx.saved_tensors
            _, *grads = fused_linear_cross_entropy_forward(
                x, weight, labels, bias, grad_loss.contiguous(), *ctx.wants, **ctx.options)
        else:
            if ctx.grads is None:
                raise RuntimeError("fused_linear_cross_entropy: backward runs once per forward "
                                   "for reduction mean and sum (the forward computed the "
                                   "gradients)")
            grads = [None if g is None else g.mul_(grad_loss) for g in ctx.grads]
            ctx.grads = None
        grads = [None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        return grads[0], grads[1], grads[2], None, None, None


def fused_linear_cross_entropy(x, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, logits_multiplier=1.0, z_loss_scale=0.0,
                               loss_dtype=None, chunk_rows=0):
    """``cross_entropy(torch.nn.functional.linear(x, weight, bias), labels, ...)`` without the
    (N, V) logits in memory: x (N, H), weight (V, H), bias (V,) or None, labels (N,). Options and
    ``loss_dtype`` as in :func:`cross_entropy`; ``chunk_rows`` 0 picks the device's default."""
    options = dict(ignore_index=ignore_index, reduction=reduction,
                   label_smoothing=label_smoothing, logits_multiplier=logits_multiplier,
                   z_loss_scale=z_loss_scale, loss_dtype=loss_dtype, chunk_rows=chunk_rows)
    return _FusedLinearCrossEntropy.apply(x, weight, bias, labels, options,
                                          torch.is_grad_enabled())


# --- rnn and gru ---------------------------------------------------------------------------------
def _recurrent_shapes(inputs, weights, input_state, cu_seqlens):
    """(output shape, final_state shape): N = the largest head count (head broadcasting)."""
    heads = max([x.shape[-2] for x in inputs] + [w.shape[0] for w in weights] +
                ([] if input_state is None else [input_state.shape[1]]))
    x = inputs[0]
    batch = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    return (*x.shape[:-2], heads, x.shape[-1]), (batch, heads, x.shape[-1])


def _max_seqlen(max_seqlen):
    return -1 if max_seqlen is None else int(max_seqlen)


def rnn_forward(input, weight, input_state=None, cu_seqlens=None, max_seqlen=None):
    """Returns (output, final_state); see rnn()."""
    out_shape, state_shape = _recurrent_shapes([input], [weight], input_state, cu_seqlens)
    output = input.new_empty(out_shape)
    final_state = input.new_empty(state_shape)
    _C.rnn(_d(input), _d(weight), _d(input_state), output, final_state, cu_seqlens=cu_seqlens,
           max_seqlen=_max_seqlen(max_seqlen), stream=_stream(input))
    return output, final_state


def rnn_backward(grad_output, grad_final_state, output, input_shape, weight, input_state=None,
                 gradient_clipping=None, cu_seqlens=None, max_seqlen=None,
                 need_input_state_grad=True):
    """Returns (grad_input, grad_weight, grad_input_state or None); the upstream gradients may be
    None (zeros). input_shape: the forward input's shape (the kernel needs only the outputs)."""
    grad_input = output.new_empty(input_shape)
    grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format)
    grad_input_state = (None if input_state is None or not need_input_state_grad
                        else torch.empty_like(input_state, memory_format=torch.contiguous_format))
    _C.rnn_backward(_d(grad_output), _d(grad_final_state), _d(output), _d(weight),
                    _d(input_state), grad_input, grad_weight, grad_input_state,
                    gradient_clipping=gradient_clipping, cu_seqlens=cu_seqlens,
                    max_seqlen=_max_seqlen(max_seqlen), stream=_stream(output))
    return grad_input, grad_weight, grad_input_state


class _Rnn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, input_state, gradient_clipping, cu_seqlens, max_seqlen):
        output, final_state = rnn_forward(input, weight, input_state, cu_seqlens, max_seqlen)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (zeros)
        ctx.save_for_backward(output, weight, input_state, cu_seqlens)
        ctx.options = (input.shape, gradient_clipping, max_seqlen)
        return output, final_state

    @staticmethod
    def backward(ctx, grad_output, grad_final_state):
        output, weight, input_state, cu_seqlens = ctx.saved_tensors
        input_shape, gradient_clipping, max_seqlen = ctx.options
        grads = rnn_backward(grad_output, grad_final_state, output, input_shape, weight,
                             input_state, gradient_clipping, cu_seqlens, max_seqlen,
                             need_input_state_grad=ctx.needs_input_grad[2])
        return (*grads, None, None, None)


def rnn(input, weight, input_state=None, gradient_clipping=None, cu_seqlens=None,
        max_seqlen=None):
    """Multi-head RNN, per head n: ``h_t = tanh(h_{t-1} @ weight[n] + input_t)``.

    input (B, S, N, H), or packed (T, N, H) with cu_seqlens (B+1,) int32/uint32/int64; weight
    (N, H, H); input_state (B, N, H) or None (zeros). Inputs and weights may have fewer heads than
    N when their count divides N (broadcast). gradient_clipping = c clamps the state's gradient to
    [-c, c] at every step of the backward. Returns (output like input with N heads,
    final_state (B, N, H))."""
    return _Rnn.apply(input, weight, input_state, gradient_clipping, cu_seqlens, max_seqlen)


def gru_forward(input, weight, forget_input, forget_weight, reset_input, reset_weight,
                input_state=None, cu_seqlens=None, max_seqlen=None):
    """Returns (output, final_state); see gru()."""
    inputs, weights = [input, forget_input, reset_input], [weight, forget_weight, reset_weight]
    out_shape, state_shape = _recurrent_shapes(inputs, weights, input_state, cu_seqlens)
    output = input.new_empty(out_shape)
    final_state = input.new_empty(state_shape)
    _C.gru(_d(input), _d(weight), _d(forget_input), _d(forget_weight), _d(reset_input),
           _d(reset_weight), _d(input_state), output, final_state, cu_seqlens=cu_seqlens,
           max_seqlen=_max_seqlen(max_seqlen), stream=_stream(input))
    return output, final_state


def gru_backward(grad_output, grad_final_state, output, input, weight, forget_input,
                 forget_weight, reset_input, reset_weight, input_state=None,
                 gradient_clipping=None, cu_seqlens=None, max_seqlen=None,
                 need_input_state_grad=True):
    """Returns the gradients of (input, weight, forget_input, forget_weight, reset_input,
    reset_weight, input_state or None); the upstream gradients may be None (zeros)."""
    params = [input, weight, forget_input, forget_weight, reset_input, reset_weight]
    grads = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
    grad_input_state = (None if input_state is None or not need_input_state_grad
                        else torch.empty_like(input_state, memory_format=torch.contiguous_format))
    _C.gru_backward(_d(grad_output), _d(grad_final_state), _d(output), *[_d(p) for p in params],
                    _d(input_state), *grads, grad_input_state,
                    gradient_clipping=gradient_clipping, cu_seqlens=cu_seqlens,
                    max_seqlen=_max_seqlen(max_seqlen), stream=_stream(output))
    return (*grads, grad_input_state)


class _Gru(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, forget_input, forget_weight, reset_input, reset_weight,
                input_state, gradient_clipping, cu_seqlens, max_seqlen):
        params = (input, weight, forget_input, forget_weight, reset_input, reset_weight)
        output, final_state = gru_forward(*params, input_state, cu_seqlens, max_seqlen)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(output, *params, input_state, cu_seqlens)
        ctx.options = (gradient_clipping, max_seqlen)
        return output, final_state

    @staticmethod
    def backward(ctx, grad_output, grad_final_state):
        output, *params, input_state, cu_seqlens = ctx.saved_tensors
        gradient_clipping, max_seqlen = ctx.options
        grads = gru_backward(grad_output, grad_final_state, output, *params, input_state,
                             gradient_clipping, cu_seqlens, max_seqlen,
                             need_input_state_grad=ctx.needs_input_grad[6])
        return (*grads, None, None, None)


def gru(input, weight, forget_input, forget_weight, reset_input, reset_weight, input_state=None,
        gradient_clipping=None, cu_seqlens=None, max_seqlen=None):
    """Multi-head GRU (Cho et al. 2014, row-vector form), per head n and step:
    ``f = sigmoid(h @ forget_weight[n] + forget_input_t)``,
    ``r = sigmoid(h @ reset_weight[n] + reset_input_t)``,
    ``z = tanh((h * r) @ weight[n] + input_t)``, ``h = f * h + (1 - f) * z``.
    Shapes, head broadcasting, packing and gradient_clipping as for rnn(); returns
    (output, final_state)."""
    return _Gru.apply(input, weight, forget_input, forget_weight, reset_input, reset_weight,
                      input_state, gradient_clipping, cu_seqlens, max_seqlen)


# --- pack_sequence, unpack_sequence, continuous_count -------------------------------------------
def pack_sequence_forward(x, cu_seqlens, padding_side="left"):
    out = x.new_empty((int(cu_seqlens[-1]), *x.shape[2:]))
    _C.pack_sequence(_d(x), cu_seqlens, out, padding_side=padding_side, stream=_stream(x))
    return out


def unpack_sequence_forward(x, cu_seqlens, batch_size, sequence_length, padding_side="left"):
    out = x.new_empty((batch_size, sequence_length, *x.shape[1:]))
    _C.unpack_sequence(_d(x), cu_seqlens, out, padding_side=padding_side, stream=_stream(x))
    return out


class _PackSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cu_seqlens, padding_side):
        ctx.save_for_backward(cu_seqlens)
        ctx.options = (x.shape[0], x.shape[1], padding_side)
        return pack_sequence_forward(x, cu_seqlens, padding_side)

    @staticmethod
    def backward(ctx, grad):
        (cu_seqlens,) = ctx.saved_tensors
        return unpack_sequence_forward(grad, cu_seqlens, *ctx.options), None, None


class _UnpackSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cu_seqlens, batch_size, sequence_length, padding_side):
        ctx.save_for_backward(cu_seqlens)
        ctx.padding_side = padding_side
        return unpack_sequence_forward(x, cu_seqlens, batch_size, sequence_length, padding_side)

    @staticmethod
    def backward(ctx, grad):
        (cu_seqlens,) = ctx.saved_tensors
        return pack_sequence_forward(grad, cu_seqlens, ctx.padding_side), None, None, None, None


def pack_sequence(x, cu_seqlens, padding_side="left"):
    """(B, S, ...) -> (T, ...): the tokens of each padded row, sequence after sequence, as
    cu_seqlens (B+1,) int32/uint32/int64 gives them ('left': the tokens sit at the end of each row).
    Any dtype; the backward is unpack_sequence."""
    return _PackSequence.apply(x, cu_seqlens, padding_side)


def unpack_sequence(x, cu_seqlens, batch_size, sequence_length, padding_side="left"):
    """(T, ...) -> (batch_size, sequence_length, ...), the padding zero-filled; the inverse of
    pack_sequence, whose forward is its backward."""
    return _UnpackSequence.apply(x, cu_seqlens, batch_size, sequence_length, padding_side)


def continuous_count(x, bins):
    """int64 counts (bins,) of each value of the 1-D int32/int64 x in [0, bins); values outside
    are ignored (torch.bincount(x, minlength=bins) when all are in range)."""
    out = torch.empty(bins, dtype=torch.int64, device=x.device)
    _C.continuous_count(x, out, stream=_stream(x))
    return out
