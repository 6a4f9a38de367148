"""meshfuse.torch's ops as torch custom ops: torch.library.opcheck on each, a transformer block
under torch.compile(fullgraph=True) against eager, and the modules against PyTorch's (skipped
without torch)."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import meshfuse  # noqa: E402
import meshfuse.torch as mt  # noqa: E402

ops = torch.ops.meshfuse
_cuda = pytest.mark.skipif(not (meshfuse.built_with_cuda() and torch.cuda.is_available()),
                           reason="needs a CUDA build of meshfuse and a GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=_cuda)]


def _randn(*shape, seed, dtype=torch.float64, grad=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_(grad)


def _opcheck(op, args):
    # The default tests: schema, autograd registration, fake tensors, AOT dispatch (static and
    # dynamic shapes).
    torch.library.opcheck(op, args)


def test_every_op_is_a_custom_op():
    names = {"swiglu", "swiglu_backward", "rmsnorm", "rmsnorm_backward", "softmax",
             "softmax_backward", "cross_entropy", "cross_entropy_backward",
             "fused_linear_cross_entropy", "rnn", "rnn_backward", "gru", "gru_backward",
             "pack_sequence", "unpack_sequence", "continuous_count"}
    assert all(hasattr(ops, name) for name in names)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad", [True, False])
def test_opcheck_swiglu_rmsnorm_softmax(grad, device):
    x = _randn(3, 16, seed=1, grad=grad, device=device)
    y = _randn(3, 16, seed=2, grad=grad, device=device)
    w = _randn(16, seed=3, grad=grad, device=device)
    _opcheck(ops.swiglu.default, (x, y))
    _opcheck(ops.rmsnorm.default, (x, None, w, 1e-6, 1.0))
    _opcheck(ops.rmsnorm.default, (x, y, w, 1e-6, 0.5))
    _opcheck(ops.rmsnorm.default, (x, y, None, 1e-6, 1.0))
    _opcheck(ops.softmax.default, (x, 0.5))
    if not grad:
        rstd = torch.rand(3, dtype=x.dtype, device=device) + 0.5  # float64 x: float64 rstd
        _opcheck(ops.swiglu_backward.default, (x, x, y))
        _opcheck(ops.rmsnorm_backward.default, (x, None, y, w, rstd, False, 1.0, True))
        _opcheck(ops.rmsnorm_backward.default, (x, y, y, w, rstd, True, 0.5, True))
        _opcheck(ops.softmax_backward.default, (x, torch.softmax(y, -1), 1.0))
        _opcheck(ops.swiglu_backward_.default, (x, x.clone(), y.clone()))  # mutates the last two
    # swiglu_mlp's activation, whose backward writes over its inputs: on copies.
    _opcheck(ops.swiglu_reusing_inputs.default, (x.clone(), y.clone()))


def test_a_meta_tensor_beside_a_real_one_is_a_device_mismatch_not_unwritten_memory():
    # torch sends such a call to the op's fake implementation, whose empty outputs on the CPU once
    # came back as the result.
    x = torch.ones(4, 8)
    cases = [
        (lambda: mt.rmsnorm(x, torch.ones(8, device="meta")), "rmsnorm: 'weight' is on the meta "
         "device and 'x' on cpu"),
        (lambda: mt.swiglu(x, torch.ones(4, 8, device="meta")), "swiglu: 'up' is on the meta "
         "device and 'gate' on cpu"),
        (lambda: mt.cross_entropy(x, torch.zeros(4, dtype=torch.long, device="meta")),
         "cross_entropy: 'labels' is on the meta device and 'logits' on cpu"),
        (lambda: mt.fused_linear_cross_entropy(x, torch.ones(5, 8, device="meta"),
                                               torch.zeros(4, dtype=torch.long)),
         "fused_linear_cross_entropy: 'weight' is on the meta device and 'x' on cpu"),
    ]
    for call, message in cases:
        with pytest.raises(meshfuse.DeviceMismatchError, match=message):
            call()
    # Every tensor on the meta device: shapes, as torch's own ops give.
    y = mt.rmsnorm(torch.ones(4, 8, device="meta"), torch.ones(8, device="meta"))
    assert y.is_meta and y.shape == (4, 8)


def test_rmsnorm_of_an_empty_hidden_dim_gives_an_empty_weight_gradient():
    # Not None: a weight of 0 elements once looked like the gradient that was not asked for.
    x = torch.randn(2, 0, requires_grad=True)
    w = torch.randn(0, requires_grad=True)
    mt.rmsnorm(x, w).sum().backward()
    assert w.grad is not None and w.grad.shape == (0,)
    assert x.grad is not None and x.grad.shape == (2, 0)


def test_rmsnorm_given_f_rms_norms_arguments_says_it_takes_no_normalized_shape():
    # It once came out of torch's dispatcher, naming the op's internal 'residual' argument.
    x = _randn(3, 5, seed=8)
    with pytest.raises(TypeError, match=r"rmsnorm: weight must be a tensor or None, got tuple "
                       r"\(rmsnorm\(x, weight, eps\) normalises the last dim"):
        mt.rmsnorm(x, (5,), torch.ones(5))
    with torch.no_grad(), pytest.raises(TypeError, match="rmsnorm: weight must be a tensor"):
        mt.rmsnorm(x, (5,))  # the eager path without autograd too
    with pytest.raises(TypeError, match="rmsnorm: x must be a tensor, got ndarray"):
        mt.rmsnorm(x.numpy())


def test_softmax_takes_pytorchs_dim_argument_and_a_keyword_multiplier():
    # mt.softmax(x, -1) once read -1 as the multiplier and returned softmax(-x).
    x = _randn(3, 5, seed=7)
    expected = torch.softmax(x, -1)
    torch.testing.assert_close(mt.softmax(x, -1), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(mt.softmax(x, 1), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(mt.softmax(x, dim=-1), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(mt.softmax(x, logits_multiplier=0.5), torch.softmax(0.5 * x, -1),
                               rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"softmax: dim must be the last dim \(-1 or 1\).*got 0"):
        mt.softmax(x, 0)
    for not_a_dim in (1.0, True):  # an old positional multiplier equal to the last dim's index
        with pytest.raises(ValueError, match="softmax: dim must be the last dim"):
            mt.softmax(x, not_a_dim)
    with pytest.raises(TypeError, match="positional"):
        mt.softmax_forward(x, 0.5)  # the raw kernels' multiplier is keyword-only too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_opcheck_cross_entropy_and_fused_linear_cross_entropy(reduction, device):
    logits = _randn(6, 20, seed=4, grad=True, device=device)
    labels = torch.tensor([1, -100, 19, 0, 7, 3], device=device)
    options = (-100, reduction, 0.1, 1.0, 1e-3)
    _opcheck(ops.cross_entropy.default, (logits, labels, *options, None))
    x = _randn(6, 8, seed=5, grad=True, device=device)
    w, b = _randn(20, 8, seed=6, grad=True, device=device), None
    upstream = (torch.ones((), dtype=torch.float64, device=device) if reduction != "none"
                else None)
    wants = (True, True, False) if reduction != "none" else (False, False, False)
    for accum_dtype in (None, torch.float64):  # float64 inputs: only theirs
        _opcheck(ops.fused_linear_cross_entropy.default,
                 (x, w, b, labels, upstream, *wants, *options, None, 4, accum_dtype))
    loss, lse = ops.cross_entropy(logits.detach(), labels, *options, None)
    _opcheck(ops.cross_entropy_backward.default,
             (torch.ones_like(loss), logits.detach(), labels, lse, *options))
    # label_check, the ops' last argument.
    _opcheck(ops.cross_entropy.default, (logits, labels, *options, None, "device_assert"))
    _opcheck(ops.fused_linear_cross_entropy.default,
             (x, w, b, labels, upstream, *wants, *options, None, 4, None, "device_assert"))
    _opcheck(ops.cross_entropy_backward.default,
             (torch.ones_like(loss), logits.detach(), labels, lse, *options, "device_assert"))


def test_fused_linear_cross_entropy_called_with_fewer_gradients_than_autograd_needs_says_so():
    # The op asked for no gradient while x and w require one: the backward failed with
    # "'NoneType' object has no attribute 'to'" (and returning none would drop the gradients).
    x, w = _randn(6, 8, seed=5, grad=True), _randn(20, 8, seed=6, grad=True)
    labels = torch.tensor([1, -100, 19, 0, 7, 3])
    loss = ops.fused_linear_cross_entropy(x, w, None, labels, None, False, False, False, -100,
                                          "mean", 0.0, 1.0, 0.0, None, 0)[0]  # accum_dtype: None
    with pytest.raises(RuntimeError, match="needs the gradient of x, weight, which the forward"):
        loss.backward()


def test_opcheck_recurrent_and_sequence_ops():
    x, w = _randn(2, 5, 2, 4, seed=7, grad=True), _randn(2, 4, 4, seed=8, grad=True) * 0.3
    h0 = _randn(2, 2, 4, seed=9, grad=True)
    _opcheck(ops.rnn.default, (x, w.detach().requires_grad_(), h0, 1.0, None, None))
    gates = [_randn(2, 5, 2, 4, seed=10 + i, grad=True) for i in range(2)]
    weights = [(_randn(2, 4, 4, seed=20 + i) * 0.3).requires_grad_() for i in range(3)]
    _opcheck(ops.gru.default, (x, weights[0], gates[0], weights[1], gates[1], weights[2], h0,
                               None, None, None))
    padded = _randn(3, 4, 2, seed=30, grad=True)
    cu_seqlens = torch.tensor([0, 2, 6, 7], dtype=torch.int32)
    _opcheck(ops.pack_sequence.default, (padded, cu_seqlens, "left"))
    _opcheck(ops.unpack_sequence.default, (_randn(7, 2, seed=31, grad=True), cu_seqlens, 3, 4,
                                           "right"))
    _opcheck(ops.continuous_count.default, (torch.tensor([0, 3, 3, 9, -1]), 5))


class _Block(torch.nn.Module):
    # A pre-norm causal self-attention + SwiGLU block and an LM head, meshfuse wherever it has the
    # op: RMSNorm, softmax, fused residual-add RMSNorm, the SwiGLU MLP and both losses.
    def __init__(self, hidden=32, heads=4, intermediate=64, vocab=50, label_check="device_assert"):
        super().__init__()
        self.heads = heads
        self.norm1 = mt.RMSNorm(hidden, eps=1e-6)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = mt.RMSNorm(hidden, eps=1e-6)
        self.mlp = mt.SwiGLUMLP(hidden, intermediate)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.fused_loss = mt.FusedLinearCrossEntropyLoss(label_smoothing=0.1, chunk_rows=5,
                                                         label_check=label_check)
        self.loss = mt.CrossEntropyLoss(z_loss_scale=1e-3, label_check=label_check)

    def forward(self, x, labels):
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        p = mt.softmax(scores.masked_fill(causal, float("-inf")), logits_multiplier=d ** -0.5)
        attention = torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, h)
        y, r = mt.fused_residual_add_rmsnorm(self.out(attention), x, self.norm2.weight, eps=1e-6)
        x = r + self.mlp(y)
        rows, labels = x.reshape(-1, h), labels.reshape(-1)
        return (self.fused_loss(rows, self.head.weight, labels) +
                self.loss(self.head(rows), labels))


def _block_and_batch(seed, device, label_check="device_assert"):
    """A _Block and a batch for it: x (2, 6, 32) and labels in [0, 50), drawn after seeding."""
    torch.manual_seed(seed)
    return (_Block(label_check=label_check).to(device), torch.randn(2, 6, 32, device=device),
            torch.randint(0, 50, (2, 6), device=device))


def _training_step(model, x, labels):
    """One training step's loss (detached) and the parameters' gradients (copies)."""
    model.zero_grad(set_to_none=True)
    loss = model(x, labels)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_transformer_block_has_no_graph_break_and_matches_eager(backend, device):
    block, x, labels = _block_and_batch(0, device)
    labels[0, 2] = -100
    eager_loss, eager_grads = _training_step(block, x, labels)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)  # a graph break raises
    loss, grads = _training_step(compiled, x, labels)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(grads, eager_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


@_cuda
@pytest.mark.parametrize("label_check", ["device_assert", "raise"])
def test_a_training_step_captured_in_a_cuda_graph_replays_on_new_inputs(label_check):
    # Every op, forward and backward, queued into one CUDA graph (the label checks wait for
    # nothing there, "raise" included): a replay on new inputs gives the eager step's loss and
    # gradients.
    block, x, labels = _block_and_batch(3, "cuda", label_check)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for _ in range(2):
            _training_step(block, x, labels)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    block.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):  # the step's outputs are the graph's, rewritten by each replay
        loss, grads = _training_step(block, x, labels)
    for seed in (4, 5):
        torch.manual_seed(seed)
        new_x = torch.randn(2, 6, 32, device="cuda")
        new_labels = torch.randint(0, 50, (2, 6), device="cuda")
        new_labels[1, seed] = -100
        x.copy_(new_x)
        labels.copy_(new_labels)
        graph.replay()
        eager_loss, eager_grads = _training_step(block, new_x, new_labels)
        for ours, theirs in zip([loss] + grads, [eager_loss] + eager_grads):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@_cuda
def test_compiled_with_cuda_graphs_matches_eager():
    # torch.compile's "reduce-overhead" mode replays the block's kernels as CUDA graphs.
    block, x, labels = _block_and_batch(6, "cuda")
    eager_loss, eager_grads = _training_step(block, x, labels)
    torch._dynamo.reset()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, recording, then replays
        loss, grads = _training_step(compiled, x, labels)
    for ours, theirs in zip([loss] + grads, [eager_loss] + eager_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


@_cuda
def test_a_bad_label_in_a_cuda_graph_stops_the_replay_with_the_error_printed():
    # A captured check cannot raise from the call, even under label_check="raise": it prints the
    # op's error and traps, as PyTorch's device-side assert does (the process's CUDA context is
    # lost, hence a subprocess).
    code = """if True:
        import torch, meshfuse.torch as mt
        logits = torch.randn(4, 50, device="cuda")
        labels = torch.tensor([1, 2, 3, 4], device="cuda")
        mt.cross_entropy(logits, labels, label_check="raise")  # warm-up, outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = mt.cross_entropy(logits, labels, label_check="raise")
        graph.replay()
        print("good replay", torch.equal(loss, mt.cross_entropy(logits, labels)))
        labels[1] = 99
        graph.replay()
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            print("raised", type(e).__name__)
        """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "good replay True" in out.stdout, out.stdout + out.stderr
    assert "cross_entropy: labels[1] = 99 is outside [0, 50)" in out.stdout + out.stderr, \
        out.stdout + out.stderr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_check_device_assert_gives_the_raise_results_bitwise(reduction, device):
    # On CUDA "device_assert" skips the host's wait and the forward's check kernel (mean's count
    # comes from the loss reduction); nothing else may change. All rows ignored: mean's NaN.
    for labels in (torch.tensor([1, -100, 19, 0, 7, 3], device=device),
                   torch.full((6,), -100, device=device)):
        results = []
        for label_check in ("raise", "device_assert"):
            logits = _randn(6, 20, seed=4, grad=True, device=device, dtype=torch.float32)
            x = _randn(6, 8, seed=5, grad=True, device=device, dtype=torch.float32)
            w = _randn(20, 8, seed=6, grad=True, device=device, dtype=torch.float32)
            ce = mt.CrossEntropyLoss(reduction=reduction, label_smoothing=0.1,
                                     label_check=label_check)(logits, labels)
            flce = mt.fused_linear_cross_entropy(x, w, labels, reduction=reduction,
                                                 label_check=label_check)
            (ce.sum() + flce.sum()).backward()
            with torch.no_grad():
                eager = mt.cross_entropy(logits, labels, reduction=reduction,
                                         label_check=label_check)
            results.append([ce, flce, eager, logits.grad, x.grad, w.grad])
        for ours, theirs in zip(*results):
            assert torch.equal(ours.isnan(), theirs.isnan())
            assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_a_bad_label_check_name_is_a_value_error_naming_the_op():
    logits, labels = torch.randn(2, 5), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"cross_entropy: label_check: unknown name 'trap' "
                                         r"\(expected one of raise, device_assert\)"):
        mt.cross_entropy(logits, labels, label_check="trap")
    with pytest.raises(ValueError, match="CrossEntropyLoss: label_check: unknown name 'Raise'"):
        mt.CrossEntropyLoss(label_check="Raise")
    with pytest.raises(ValueError, match="fused_linear_cross_entropy: label_check"):
        mt.fused_linear_cross_entropy(torch.randn(2, 3), torch.randn(5, 3), labels,
                                      label_check="")
    # The raw kernels' names are checked in C++.
    with pytest.raises(ValueError, match="cross_entropy: label_check: unknown name 'x'"):
        mt.cross_entropy_forward(logits, labels, label_check="x")
    # On the CPU the labels are checked on the host: "device_assert" raises as "raise" does.
    with pytest.raises(ValueError, match=r"labels\[1\] = 5 is outside \[0, 5\)"):
        mt.cross_entropy(logits, torch.tensor([1, 5]), label_check="device_assert")


def test_the_losses_default_to_pytorchs_bad_label_behaviour():
    # meshfuse.torch promises F.cross_entropy's semantics: a device-side assert on CUDA.
    import inspect
    for fn in (mt.cross_entropy, mt.fused_linear_cross_entropy, mt.cross_entropy_forward,
               mt.cross_entropy_backward, mt.fused_linear_cross_entropy_forward,
               mt.CrossEntropyLoss, mt.FusedLinearCrossEntropyLoss):
        assert inspect.signature(fn).parameters["label_check"].default == "device_assert", fn
    assert mt.CrossEntropyLoss().label_check == "device_assert"

# A bad label's call under label_check="device_assert" by each path (the raw kernel, the custom op
# with autograd, fused linear cross-entropy, the backward's check kernel): the message it prints.
_BAD_LABEL_CALLS = {
    "eager": ("mt.cross_entropy(logits, labels, label_check='device_assert')",
              "cross_entropy: labels[1] = 99 is outside [0, 50)"),
    "autograd": ("mt.cross_entropy(logits.requires_grad_(), labels, label_check='device_assert')",
                 "cross_entropy: labels[1] = 99 is outside [0, 50)"),
    "flce": ("mt.fused_linear_cross_entropy(torch.randn(4, 8, device='cuda', requires_grad=True), "
             "torch.randn(50, 8, device='cuda'), labels, label_check='device_assert')",
             "fused_linear_cross_entropy: labels[1] = 99 is outside [0, 50)"),
    "backward": ("mt.cross_entropy_backward(torch.ones((), device='cuda'), logits, labels, "
                 "torch.zeros(4, dtype=torch.float64, device='cuda'), "
                 "label_check='device_assert')",
                 "cross_entropy_backward: labels[1] = 99 is outside [0, 50)"),
}


@_cuda
@pytest.mark.parametrize("path", list(_BAD_LABEL_CALLS))
def test_a_bad_label_with_device_assert_returns_and_then_traps_with_the_error_printed(path):
    # No host wait: the call returns, and the kernel prints the op's error and traps (the
    # process's CUDA context is lost, hence a subprocess); "raise" raises from the call. The
    # path runs once on good labels first (modules loaded, caches warm: nothing left to set up
    # that might synchronise), and the GPU is kept busy while the bad call queues its kernels,
    # so the trap cannot reach a CUDA call of the op itself: any wait in the call shows as an
    # error from it.
    call, message = _BAD_LABEL_CALLS[path]
    code = f"""if True:
        import torch, meshfuse.torch as mt
        logits = torch.randn(4, 50, device="cuda")
        labels = torch.tensor([1, 2, -100, 3], device="cuda")
        good = mt.cross_entropy(logits, labels, label_check="device_assert")
        print("good", torch.equal(good, mt.cross_entropy(logits, labels, label_check="raise")),
              flush=True)
        {call}
        torch.cuda.synchronize()
        labels[1] = 99
        try:
            mt.cross_entropy(logits, labels, label_check="raise")
        except ValueError as e:
            print("raised from the call:", e, flush=True)
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the bad call's kernels
        try:
            {call}
            print("returned", flush=True)
        except Exception as e:
            print("the call raised", type(e).__name__, e, flush=True)
        torch.cuda.synchronize()  # also flushes the kernel's printf
        print("synchronize returned", flush=True)
        """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    text = out.stdout + out.stderr
    assert "good True" in out.stdout, text
    assert "raised from the call: [invalid argument] cross_entropy: labels[1] = 99" in out.stdout, \
        text
    assert "the call raised" not in out.stdout and "returned" in out.stdout, text
    assert message in text, text
    assert "synchronize returned" not in out.stdout, text


def test_inference_takes_the_raw_kernels_eagerly_and_the_ops_when_compiled():
    # Eager calls without autograd skip the custom op's dispatch (the same kernels, the same
    # result); torch.compile still sees the ops, with no graph break.
    torch.manual_seed(2)
    block = _Block()
    x, labels = torch.randn(2, 6, 32), torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        eager = block(x, labels)
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, labels)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eager, block(x, labels).detach())
    with torch.no_grad():  # parameters are plain tensors to the fast path
        assert mt._untraced(x, block.norm1.weight)
        assert not mt._untraced(torch._subclasses.FakeTensorMode().from_tensor(x))


def test_tracers_of_plain_tensors_see_the_op_not_a_constant():
    # make_fx in real mode and torch.jit.trace run on plain tensors under no_grad, where the eager
    # fast path would leave the raw kernel's result as a constant in their graph.
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.overrides import TorchFunctionMode

    x, w = torch.randn(3, 8), torch.randn(8)

    def norm(x, w):
        return mt.rmsnorm(x, w, 1e-5)

    with torch.no_grad():
        graph = make_fx(norm)(x, w)
        assert "meshfuse.rmsnorm" in str(graph.graph)
        x2 = torch.randn(3, 8)  # a constant would give x's result again
        torch.testing.assert_close(graph(x2, w), F.rms_norm(x2, (8,), w, 1e-5))
        traced = torch.jit.trace(norm, (x, w), check_trace=False)
        assert "meshfuse::rmsnorm" in str(traced.graph)
        torch.testing.assert_close(traced(x2, w), F.rms_norm(x2, (8,), w, 1e-5))
        with TorchFunctionMode():
            assert not mt._untraced(x, w)
        assert mt._untraced(x, w)


def test_vmap_runs_the_ops_per_sample():
    # vmap's batched tensors are Tensors with no storage to export: the functions take the op
    # (and its per-sample fallback), not the raw kernel.
    x, w = torch.randn(3, 2, 8), torch.randn(8)
    cases = [
        (lambda a: mt.rmsnorm(a, w, 1e-5), lambda a: F.rms_norm(a, (8,), w, 1e-5)),
        (lambda a: mt.fused_residual_add_rmsnorm(a, a, w, 1e-5)[0],
         lambda a: F.rms_norm(2 * a, (8,), w, 1e-5)),
        (lambda a: mt.softmax(a), lambda a: torch.softmax(a, -1)),
        (lambda a: mt.swiglu(a, a), lambda a: F.silu(a) * a),
    ]
    for ours, theirs in cases:
        torch.testing.assert_close(torch.vmap(ours)(x), theirs(x))


def test_forward_mode_derivatives_are_refused_instead_of_coming_out_zero():
    # torch.func.jvp gave zero tangents through the custom ops, and a dual tensor's tangent was
    # dropped by the raw kernel, without an error.
    import torch.autograd.forward_ad as fwad
    x, t, w = torch.randn(2, 5), torch.randn(2, 5), torch.randn(5)
    labels = torch.tensor([0, 3])
    calls = [lambda: torch.func.jvp(mt.softmax, (x,), (t,)),
             lambda: torch.func.jacfwd(mt.swiglu)(x[0], x[1]),
             lambda: torch.vmap(lambda a: torch.func.jvp(mt.softmax, (a,), (a,)))(x),
             lambda: torch.func.jvp(lambda a: mt.fused_linear_cross_entropy(a, w[None], labels[:1]),
                                    (x[:1],), (t[:1],))]
    for call in calls:
        with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
            call()
    with fwad.dual_level():
        dual = fwad.make_dual(x, t)
        for call in (lambda: mt.rmsnorm(dual), lambda: mt.cross_entropy(dual, labels)):
            with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
                call()
        # Tensors without a tangent are served inside a forward-AD level.
        torch.testing.assert_close(mt.softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(torch.vmap(mt.softmax)(x), torch.softmax(x, -1))  # still taken


def test_rmsnorm_module_matches_torch_with_its_default_eps_and_state_dict():
    # Small values: an eps of bf16's machine epsilon instead of fp32's would show.
    x = torch.randn(4, 3, 16, dtype=torch.bfloat16) * 0.01
    ours, theirs = mt.RMSNorm(16, dtype=torch.bfloat16), torch.nn.RMSNorm(16, dtype=torch.bfloat16)
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), theirs(x))
    two = mt.RMSNorm((3, 16), eps=1e-5, dtype=torch.float64)
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(two(x), F.rms_norm(x, (3, 16), two.weight, 1e-5))
    with pytest.raises(ValueError, match="trailing shape"):
        two(torch.randn(4, 16, dtype=torch.float64))
    assert "eps=1e-05" in repr(two)
    # No rows: reshape could not infer the row length of an input of no elements.
    for shape in [(0, 3, 16), (2, 0, 3, 16)]:
        empty = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        y = two(empty)
        assert y.shape == shape
        y.sum().backward()
        assert empty.grad.shape == shape
    # Built on the meta device and materialised, as FSDP2 and torchtitan initialise modules.
    with torch.device("meta"):
        meta = mt.RMSNorm((3, 16), dtype=torch.float64)
    meta.to_empty(device="cpu").reset_parameters()
    assert torch.equal(meta.weight, torch.ones(3, 16, dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_mlp_backward_over_its_projections_matches_torch_and_refuses_a_second_pass(device):
    # swiglu_mlp's activation writes its gradients over gate and up: every gradient of a step
    # still equals the unfused block's, and a second backward through the graph, which would read
    # those gradients as activations, raises.
    torch.manual_seed(2)
    mlp = mt.SwiGLUMLP(16, 40, bias=True, dtype=torch.float64, device=device)
    x = torch.randn(2, 3, 16, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn(2, 3, 16, dtype=torch.float64, device=device)

    def grads(forward):
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        out = forward(x)
        out.backward(dy, retain_graph=True)
        return out, [g.clone() for g in [x.grad] + [p.grad for p in mlp.parameters()]]

    out, ours = grads(mlp)
    _, theirs = grads(lambda x: mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="swiglu_mlp: a second backward through the same graph"):
        out.backward(dy)
    # Saved-tensor hooks skip autograd's version check; the backward itself still refuses.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = mlp(x)
    out.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.backward(dy)
    # create_graph: separate outputs, whose missing second-order formula is an error, not a
    # silent derivative of the forward's history.
    (grad_x,) = torch.autograd.grad(mlp(x), x, dy, create_graph=True)
    torch.testing.assert_close(grad_x, theirs[0])
    with pytest.raises(RuntimeError, match="no autograd formula"):
        grad_x.sum().backward()


def test_swiglu_mlp_module_and_losses_match_torch():
    torch.manual_seed(1)
    mlp = mt.SwiGLUMLP(16, 40, dtype=torch.float64)
    x = torch.randn(3, 16, dtype=torch.float64)
    expected = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected)
    logits, labels = torch.randn(5, 9, dtype=torch.float64), torch.tensor([0, 8, -100, 3, 3])
    for reduction in ("mean", "sum", "none"):
        ours = mt.CrossEntropyLoss(reduction=reduction, label_smoothing=0.2)(logits, labels)
        theirs = torch.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=0.2)(logits, labels)
        torch.testing.assert_close(ours, theirs)
    weight = torch.randn(9, 16, dtype=torch.float64)
    hidden = torch.randn(5, 16, dtype=torch.float64)
    torch.testing.assert_close(mt.FusedLinearCrossEntropyLoss()(hidden, weight, labels),
                               F.cross_entropy(F.linear(hidden, weight), labels))
    with pytest.raises(NotImplementedError, match="class weights"):
        mt.CrossEntropyLoss(weight=torch.ones(9))
    # torch's positional order: (weight, size_average, ignore_index, reduce, reduction, ...);
    # the deprecated size_average / reduce set the reduction as torch's do.
    labels = labels.clamp(min=0)  # 3 is the ignore_index now
    ours = mt.CrossEntropyLoss(None, None, 3, None, "sum")(logits, labels)
    torch.testing.assert_close(ours, torch.nn.CrossEntropyLoss(None, None, 3, None, "sum")(
        logits, labels))
    with pytest.warns(UserWarning, match="size_average and reduce args will be deprecated"):
        legacy = mt.FusedLinearCrossEntropyLoss(size_average=False)
    assert legacy.reduction == "sum"
    with pytest.raises(ValueError, match="CrossEntropyLoss: reduction: unknown name 'avg'"):
        mt.CrossEntropyLoss(reduction="avg")
    # torch's names exactly: the C++ parser's other cases gave a shape error naming 'loss'.
    eye = torch.eye(9, dtype=torch.float64)
    for loss in (mt.cross_entropy,
                 lambda x, y, **kw: mt.fused_linear_cross_entropy(x, eye, y, **kw)):
        with pytest.raises(ValueError, match=r"reduction: unknown name 'NONE' \(expected one of"):
            loss(logits, labels, reduction="NONE")


def test_a_global_forward_hook_keeps_the_projections_outputs_of_swiglu_mlp():
    # The activation writes its gradients over gate and up only where nothing else holds them:
    # a global forward hook may keep them, as one on the projection itself may.
    torch.manual_seed(3)
    kept = {}
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: kept.__setitem__(module, out))
    try:
        mlp = mt.SwiGLUMLP(8, 16, dtype=torch.float64)
        x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
        y = mlp(x)
        before = kept[mlp.gate_proj].detach().clone()
        y.sum().backward()
        torch.testing.assert_close(kept[mlp.gate_proj].detach(), before, rtol=0, atol=0)
    finally:
        handle.remove()


def test_lazily_negated_views_give_torchs_results():
    # torch._neg_view (and x.conj().imag) set the negative bit, which DLPack does not carry: the
    # eager path read x instead of -x.
    torch.manual_seed(4)
    x = torch._neg_view(torch.randn(4, 8, dtype=torch.float64))
    up = torch.randn(4, 8, dtype=torch.float64)
    labels = torch.tensor([0, 7, 3, 1])
    assert x.is_neg()
    for ours, theirs in [(mt.softmax(x), torch.softmax(x, -1)),
                         (mt.swiglu(x, up), F.silu(x) * up),
                         (mt.swiglu(up, x), F.silu(up) * x),
                         (mt.rmsnorm(x, None, eps=1e-6), F.rms_norm(x, (8,), eps=1e-6)),
                         (mt.cross_entropy(x, labels), F.cross_entropy(x, labels))]:
        torch.testing.assert_close(ours, theirs)


def test_fp32_loss_of_16_bit_logits_matches_the_reference_backend():
    # loss_dtype=float32 on the cpu backend against the reference (double) backend, both losses.
    import meshfuse

    logits = torch.randn(16, 300, dtype=torch.bfloat16)
    labels = torch.randint(0, 300, (16,))
    x, w = torch.randn(16, 32, dtype=torch.float16), torch.randn(300, 32, dtype=torch.float16)
    for reduction in ("mean", "sum", "none"):
        ours = (mt.cross_entropy(logits, labels, reduction=reduction, loss_dtype=torch.float32),
                mt.fused_linear_cross_entropy(x, w, labels, reduction=reduction,
                                              loss_dtype=torch.float32))
        with meshfuse.force_kernel_backend("reference"):
            ref = (mt.cross_entropy(logits, labels, reduction=reduction, loss_dtype=torch.float32),
                   mt.fused_linear_cross_entropy(x, w, labels, reduction=reduction,
                                                 loss_dtype=torch.float32))
        for a, b in zip(ours, ref):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Another loss_dtype is named as the argument (the kernel's error named its 'loss' output).
    with pytest.raises(TypeError, match=r"cross_entropy: loss_dtype must be None, the inputs' "
                       r"dtype \(torch.bfloat16\) or torch.float32, got torch.float64"):
        mt.cross_entropy(logits, labels, loss_dtype=torch.float64)
    with pytest.raises(TypeError, match=r"fused_linear_cross_entropy: loss_dtype must be None, "
                       r"the inputs' dtype \(torch.float16\) or torch.float32, got torch.int32"):
        mt.fused_linear_cross_entropy(x, w, labels, loss_dtype=torch.int32)
    # float32 is for 16-bit inputs only (the kernels take no f32 loss of f64 logits).
    with pytest.raises(TypeError, match=r"cross_entropy: loss_dtype must be None, the inputs' "
                       r"dtype \(torch.float64\), got torch.float32"):
        mt.cross_entropy(logits.double(), labels, loss_dtype=torch.float32)
    # Traced (the fake implementations, as torch.compile runs them): refused there too.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(), pytest.raises(TypeError, match="cross_entropy: loss_dtype must be"):
        mt.cross_entropy(torch.empty(4, 8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long),
                         loss_dtype=torch.float64)


def test_import_error_without_torch_says_what_to_install():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import meshfuse.torch\nexcept ModuleNotFoundError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "meshfuse.torch needs PyTorch" in out.stdout
