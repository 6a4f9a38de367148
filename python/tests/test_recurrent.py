"""meshfuse.torch.rnn / gru against a per-step PyTorch loop with autograd (skipped without torch)."""

import pytest

torch = pytest.importorskip("torch")

import meshfuse  # noqa: E402
import meshfuse.torch as mt  # noqa: E402


def _leaf(*shape, seed, std=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=dtype) * std).requires_grad_()


def _clamped(h, clip):
    # The seed library's gradient clipping: the state's gradient clamped at every step.
    if clip is not None and h.requires_grad:
        h.register_hook(lambda g: g.clamp(-clip, clip))
    return h


def _loop(step, inputs, weights, h0, clip, cu_seqlens):
    """Per-step loop over (B, S, Nx, H) or packed (T, Nx, H) inputs; repeats broadcast heads."""
    heads = max([x.shape[-2] for x in inputs] + [w.shape[0] for w in weights] +
                ([] if h0 is None else [h0.shape[1]]))
    inputs = [x.repeat_interleave(heads // x.shape[-2], dim=-2) for x in inputs]
    weights = [w.repeat_interleave(heads // w.shape[0], dim=0) for w in weights]
    if cu_seqlens is None:
        batch, seq = inputs[0].shape[:2]
        spans = [(b, [(b, s) for s in range(seq)]) for b in range(batch)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(b, list(range(cu[b], cu[b + 1]))) for b in range(len(cu) - 1)]
    hidden = inputs[0].shape[-1]
    outputs, finals = {}, []
    for b, rows in spans:
        h = (torch.zeros(heads, hidden, dtype=inputs[0].dtype) if h0 is None else h0[b])
        for row in rows:
            h = _clamped(step([x[row] for x in inputs], weights, h), clip)
            outputs[row] = h
        finals.append(h)
    if cu_seqlens is None:
        batch, seq = inputs[0].shape[:2]
        output = torch.stack([torch.stack([outputs[(b, s)] for s in range(seq)])
                              for b in range(batch)]) if seq else inputs[0].new_zeros(
                                  batch, 0, heads, hidden)
    else:
        t = inputs[0].shape[0]
        output = (torch.stack([outputs[r] for r in range(t)]) if t
                  else inputs[0].new_zeros(0, heads, hidden))
    return output, torch.stack(finals)


def _mm(h, w):
    return (h.unsqueeze(-2) @ w).squeeze(-2)  # per head: (N, H) @ (N, H, H)


def _rnn_step(x, w, h):
    return torch.tanh(_mm(h, w[0]) + x[0])


def _gru_step(x, w, h):
    f = torch.sigmoid(_mm(h, w[1]) + x[1])
    r = torch.sigmoid(_mm(h, w[2]) + x[2])
    z = torch.tanh(_mm(h * r, w[0]) + x[0])
    return f * h + (1 - f) * z


def _problem(gru, lead, batch, heads, hidden, seed, input_heads=None, weight_heads=None,
             state=True, dtype=torch.float64):
    pairs = 3 if gru else 1
    inputs = [_leaf(*lead, input_heads or heads, hidden, seed=seed + k, dtype=dtype)
              for k in range(pairs)]
    weights = [_leaf(weight_heads or heads, hidden, hidden, seed=seed + 10 + k,
                     std=hidden ** -0.5, dtype=dtype) for k in range(pairs)]
    h0 = _leaf(batch, heads, hidden, seed=seed + 20, std=0.5, dtype=dtype) if state else None
    return inputs, weights, h0


def _ours(gru, inputs, weights, h0, clip=None, cu_seqlens=None, max_seqlen=None):
    if gru:
        (x, xf, xr), (w, wf, wr) = inputs, weights
        return mt.gru(x, w, xf, wf, xr, wr, h0, clip, cu_seqlens, max_seqlen)
    return mt.rnn(inputs[0], weights[0], h0, clip, cu_seqlens, max_seqlen)


def _check(gru, inputs, weights, h0, clip=None, cu_seqlens=None, tol=1e-10, seed=0):
    ours = _ours(gru, inputs, weights, h0, clip, cu_seqlens)
    theirs = _loop(_gru_step if gru else _rnn_step, inputs, weights, h0, clip, cu_seqlens)
    leaves = [*inputs, *weights] + ([] if h0 is None else [h0])
    g = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.detach().to(a.dtype), rtol=tol, atol=tol)
    grads_ours = torch.autograd.grad(ours, leaves, upstream)
    grads_theirs = torch.autograd.grad(theirs, leaves, upstream)
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize("gru", [False, True], ids=["rnn", "gru"])
def test_padded_input_matches_a_per_step_torch_loop(gru):
    _check(gru, *_problem(gru, (3, 5), 3, 2, 7, seed=1))


@pytest.mark.parametrize("gru", [False, True], ids=["rnn", "gru"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.uint32], ids=["int32", "uint32"])
def test_packed_input_with_empty_sequences_matches_the_loop(gru, index_dtype):
    cu = torch.tensor([0, 3, 3, 4, 8]).to(index_dtype)
    _check(gru, *_problem(gru, (8,), 4, 2, 5, seed=2), cu_seqlens=cu)


@pytest.mark.parametrize("gru", [False, True], ids=["rnn", "gru"])
def test_broadcast_heads_without_input_state_match_repeated_heads(gru):
    _check(gru, *_problem(gru, (2, 4), 2, 4, 6, seed=3, input_heads=1, weight_heads=2,
                          state=False))


@pytest.mark.parametrize("gru", [False, True], ids=["rnn", "gru"])
def test_gradient_clipping_matches_clamp_hooks_on_each_state(gru):
    inputs, weights, h0 = _problem(gru, (2, 6), 2, 2, 8, seed=4)
    _check(gru, inputs, weights, h0, clip=0.05)
    # ... and the clamp changes the gradients.
    a = torch.autograd.grad(_ours(gru, inputs, weights, h0, 0.05)[0].sum(), weights[0])[0]
    b = torch.autograd.grad(_ours(gru, inputs, weights, h0)[0].sum(), weights[0])[0]
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("gru", [False, True], ids=["rnn", "gru"])
def test_bf16_matches_the_float64_loop_within_bf16_rounding(gru):
    inputs, weights, h0 = _problem(gru, (2, 6), 2, 2, 16, seed=5, dtype=torch.bfloat16)
    ours = _ours(gru, inputs, weights, h0)
    wide = [[t.detach().double() for t in group] for group in (inputs, weights)]
    theirs = _loop(_gru_step if gru else _rnn_step, *wide, h0.detach().double(), None, None)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2)


def test_only_the_final_state_may_carry_a_gradient():
    inputs, weights, h0 = _problem(False, (2, 3), 2, 2, 4, seed=6)
    _, final = mt.rnn(inputs[0], weights[0], h0)
    _, final_ref = _loop(_rnn_step, inputs, weights, h0, None, None)
    a = torch.autograd.grad(final.sum(), [inputs[0], weights[0], h0])
    b = torch.autograd.grad(final_ref.sum(), [inputs[0], weights[0], h0])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_bad_cu_seqlens_raise_meshfuse_errors():
    inputs, weights, _ = _problem(False, (5,), 2, 1, 3, seed=7)
    with pytest.raises(meshfuse.Error, match="cu_seqlens must start at 0"):
        mt.rnn(inputs[0], weights[0], cu_seqlens=torch.tensor([1, 3, 5]))
    with pytest.raises(meshfuse.Error, match="max_seqlen = 2 is smaller"):
        mt.rnn(inputs[0], weights[0], cu_seqlens=torch.tensor([0, 2, 5]), max_seqlen=2)
