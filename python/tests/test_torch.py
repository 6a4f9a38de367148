"""The PyTorch adapter: forward and autograd against torch.nn.functional (skipped without torch)."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import meshfuse.torch as mt  # noqa: E402


def _leaf(*shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


def _check(ours, theirs, inputs, tol=1e-10):
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
    grad = torch.randn_like(ours)
    a = torch.autograd.grad(ours, inputs, grad)
    b = torch.autograd.grad(theirs, inputs, grad)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_swiglu_matches_silu_times_up():
    gate, up = _leaf(4, 33, seed=1), _leaf(4, 33, seed=2)
    _check(mt.swiglu(gate, up), F.silu(gate) * up, (gate, up))


def test_rmsnorm_matches_torch_rms_norm():
    x, w = _leaf(3, 5, 64, seed=3), _leaf(64, seed=4)
    _check(mt.rmsnorm(x, w, eps=1e-5), F.rms_norm(x, (64,), w, 1e-5), (x, w), tol=1e-6)


def test_fused_residual_add_rmsnorm_matches_its_definition():
    x, res, w = _leaf(6, 32, seed=5), _leaf(6, 32, seed=6), _leaf(32, seed=7)
    y, r = mt.fused_residual_add_rmsnorm(x, res, w, eps=1e-6, multiplier=0.5)
    r_ref = x * 0.5 + res
    _check(y + r, F.rms_norm(r_ref, (32,), w, 1e-6) + r_ref, (x, res, w), tol=1e-6)


def test_fused_residual_add_rmsnorm_with_multiplier_one_gives_both_inputs_dx():
    # With multiplier 1 the backward writes dx once and returns it for x and residual.
    x, res, w = _leaf(6, 32, seed=10), _leaf(6, 32, seed=11), _leaf(32, seed=12)
    y, r = mt.fused_residual_add_rmsnorm(x, res, w, eps=1e-6)
    r_ref = x + res
    _check(y + r, F.rms_norm(r_ref, (32,), w, 1e-6) + r_ref, (x, res, w), tol=1e-6)
    y, r = mt.fused_residual_add_rmsnorm(x, res, w, eps=1e-6)
    (y * r).sum().backward()
    torch.testing.assert_close(x.grad, res.grad, rtol=0, atol=0)
    # One tensor as both inputs: its gradient is the sum of the two.
    z = _leaf(6, 32, seed=13)
    y2, r2 = mt.fused_residual_add_rmsnorm(z, z, w, eps=1e-6)
    _check(y2 + r2, F.rms_norm(z + z, (32,), w, 1e-6) + (z + z), (z, w), tol=1e-6)


def test_softmax_matches_torch():
    x = _leaf(3, 100, seed=8)
    _check(mt.softmax(x, logits_multiplier=0.7), torch.softmax(0.7 * x, -1), (x,))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch_with_ignore_index_and_smoothing(reduction):
    logits = _leaf(8, 50, seed=9)
    labels = torch.tensor([1, -100, 49, 0, 7, -100, 3, 3])
    ours = mt.cross_entropy(logits, labels, reduction=reduction, label_smoothing=0.1)
    theirs = F.cross_entropy(logits, labels, reduction=reduction, label_smoothing=0.1)
    _check(ours, theirs, (logits,))
