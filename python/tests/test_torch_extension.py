"""meshfuse's torch extension (_torch_ops: the eager forward kernels called on torch tensors)
against the DLPack path of _meshfuse that replaces it where it is not built: bitwise the same
outputs and the same errors, on the CPU and CUDA; used only under the torch it was built for."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import meshfuse  # noqa: E402
import meshfuse.torch as mt  # noqa: E402

_cuda = pytest.mark.skipif(not (meshfuse.built_with_cuda() and torch.cuda.is_available()),
                           reason="needs a CUDA build of meshfuse and a GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=_cuda)]
_built = pytest.mark.skipif(not mt.has_torch_extension(),
                            reason="meshfuse was built without torch (no _torch_ops)")


def test_the_extension_is_built_where_the_build_had_torch():
    # scripts/test.sh builds with torch installed and sets this: a build that silently lost the
    # extension (torch not found, a CMake change) fails here rather than running slower.
    if os.environ.get("MESHFUSE_EXPECT_TORCH_EXTENSION") != "1":
        pytest.skip("MESHFUSE_EXPECT_TORCH_EXTENSION=1 not set (scripts/test.sh sets it)")
    assert mt.has_torch_extension()
    from meshfuse import _torch_build
    assert _torch_build.TORCH_VERSION == torch.__version__


def _both_paths(fn):
    """fn() through the extension, then through the DLPack path."""
    saved = mt._T
    try:
        ours = fn()
        mt._T = None
        return ours, fn()
    finally:
        mt._T = saved


def _randn(*shape, seed, dtype, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _assert_bitwise(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    assert a.is_contiguous() and b.is_contiguous()
    # As bytes: NaN (an all -inf row, mean over no rows) compares equal to itself.
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _inputs(device, dtype):
    # Rows that are not a multiple of anything, a width that is not a multiple of the vector
    # width, a non-contiguous view, no rows, and -inf in a row.
    x = _randn(5, 3, 37, seed=1, dtype=dtype, device=device)
    x[1, 2, 5] = float("-inf")
    wide = _randn(6, 80, seed=2, dtype=dtype, device=device)
    return {"3-d": x, "strided": wide[:, ::2], "no rows": x[:0], "one row": x[0, :1]}


@_built
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_extension_gives_the_dlpack_paths_outputs_bitwise(device, dtype):
    for name, x in _inputs(device, dtype).items():
        h = x.shape[-1]
        w = _randn(h, seed=3, dtype=dtype, device=device)
        up = _randn(*x.shape, seed=4, dtype=dtype, device=device)
        for call in (lambda: mt.softmax_forward(x, logits_multiplier=0.7),
                     lambda: mt.swiglu_forward(x, up),
                     lambda: mt.rmsnorm_forward(x, w, 1e-5),
                     lambda: mt.rmsnorm_forward(x, None, 1e-5, save_rstd=False)):
            ours, dlpack = _both_paths(call)
            for a, b in zip(ours if isinstance(ours, tuple) else (ours,),
                            dlpack if isinstance(dlpack, tuple) else (dlpack,)):
                _assert_bitwise(a, b)
        logits = x.reshape(-1, h)
        labels = torch.arange(logits.shape[0], device=device) * 7 % h
        if len(labels) > 1:
            labels[1] = -100
        for reduction in ("mean", "sum", "none"):
            for options in ({}, {"label_smoothing": 0.1, "z_loss_scale": 1e-4,
                                 "logits_multiplier": 0.5},
                            {"loss_dtype": None if dtype == torch.float64 else torch.float32,
                             "save_lse": False},
                            {"vocab_start": h, "vocab_size": 3 * h}):
                ours, dlpack = _both_paths(lambda: mt.cross_entropy_forward(
                    logits, labels, reduction=reduction, **options))
                for a, b in zip(ours, dlpack):
                    _assert_bitwise(a, b)


@_built
@pytest.mark.parametrize("device", DEVICES)
def test_lazily_negated_tensors_are_read_with_their_sign(device):
    x, w, up = (_randn(4, 16, seed=s, dtype=torch.float32, device=device) for s in (5, 6, 7))
    neg = [torch._neg_view(t) for t in (x, w[0], up)]
    assert all(t.is_neg() for t in neg)
    torch.testing.assert_close(mt.softmax_forward(neg[0]), torch.softmax(-x, -1), rtol=0,
                               atol=1e-6)
    # One negated operand at a time: rmsnorm of -x with weight -w is rmsnorm of x with w.
    for call in (lambda: mt.softmax_forward(neg[0]), lambda: mt.swiglu_forward(neg[0], up),
                 lambda: mt.swiglu_forward(x, neg[2]),
                 lambda: mt.rmsnorm_forward(neg[0], w[0], 1e-5),
                 lambda: mt.rmsnorm_forward(x, neg[1], 1e-5)):
        ours, dlpack = _both_paths(call)
        for a, b in zip(ours if isinstance(ours, tuple) else (ours,),
                        dlpack if isinstance(dlpack, tuple) else (dlpack,)):
            _assert_bitwise(a, b)


@_built
def test_what_is_not_a_dense_torch_tensor_is_named():
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match=r"softmax: 'x' must be a torch.Tensor, got numpy.ndarray"):
        mt.softmax_forward(x.numpy())
    with pytest.raises(TypeError, match=r"rmsnorm: 'weight' must be a torch.Tensor or None, "
                                        r"got list"):
        mt.rmsnorm_forward(x, [1.0] * 16, 1e-5)
    with pytest.raises(meshfuse.UnsupportedError,
                       match=r"softmax: 'x' is a tensor of layout Sparse; meshfuse's ops take "
                             r"strided \(dense\) tensors"):
        mt.softmax_forward(x.to_sparse())


@_built
@_cuda
def test_the_extension_runs_on_the_current_stream():
    # A side stream, and a CUDA graph's capture stream: a kernel queued elsewhere would run
    # before the side stream's sleep ends (and read x before it is written), or escape the
    # capture (an error, or a replay that leaves y as it was).
    x = _randn(8, 512, seed=8, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # cycles: tens of milliseconds
        x2 = x * 2
        y = mt.softmax_forward(x2)
    torch.cuda.synchronize()
    _assert_bitwise(y, mt.softmax_forward(x * 2))

    static = x.clone()
    with torch.inference_mode():
        mt.softmax_forward(static)  # warm-up outside the capture (plans, allocator)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mt.softmax_forward(static)
        static.copy_(x * 3)
        graph.replay()
    torch.cuda.synchronize()
    _assert_bitwise(out, mt.softmax_forward(x * 3))


@_built
@pytest.mark.parametrize("device", DEVICES)
def test_the_extension_raises_the_dlpack_paths_errors(device):
    x = _randn(4, 16, seed=6, dtype=torch.bfloat16, device=device)
    labels = torch.tensor([0, 3, 16, 1], device=device)  # 16 is outside [0, 16)
    # An unsupported dtype: the extension names x; the DLPack path named y, the output allocated
    # like x, which its binding happened to convert first.
    ours, dlpack = _both_paths(lambda: _error_of(lambda: mt.softmax_forward(x.to(torch.int16))))
    assert ours[0] is dlpack[0] is meshfuse.DTypeMismatchError
    assert "softmax: 'x' is an array of dtype int16, which no meshfuse op takes" in ours[1]
    calls = [
        lambda: mt.rmsnorm_forward(x, x[0, :5], 1e-5),
        lambda: mt.rmsnorm_forward(x, None, -1.0),
        lambda: mt.swiglu_forward(x, x[:, :8]),
        lambda: mt.swiglu_forward(x, x.float()),
        # "raise": the default ("device_assert") would trap on CUDA, with no error to compare.
        lambda: mt.cross_entropy_forward(x, labels, label_check="raise"),
        lambda: mt.cross_entropy_forward(x, labels[:2]),
        lambda: mt.cross_entropy_forward(x, labels.float()),
        lambda: mt.cross_entropy_forward(x, labels, reduction="avg"),
        lambda: mt.cross_entropy_forward(x, labels, label_check="never"),
    ]
    for call in calls:
        ours, dlpack = _both_paths(lambda: _error_of(call))
        assert issubclass(ours[0], meshfuse.Error)
        assert ours == dlpack


def _error_of(call):
    try:
        call()
    except meshfuse.Error as e:
        return type(e), str(e)
    pytest.fail("no error raised")


def _import_on_the_dlpack_path(setup, check=""):
    """Runs `setup`, then imports meshfuse.torch in a fresh interpreter (the loaded one stays as it
    is), asserts that it took the DLPack path, runs `check`; returns the warnings it gave."""
    code = ("import sys, types, warnings, torch\n" + setup +
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import meshfuse.torch as mt\n"
            "assert not mt.has_torch_extension()\n" + check +
            "print([str(x.message) for x in w])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@_built
def test_an_extension_built_for_another_torch_is_not_loaded():
    # Its C++ ABI is that torch's: loading it under another could crash. The check runs before
    # the import.
    warnings = _import_on_the_dlpack_path(
        "torch.__version__ = '0.0.1'\n",
        check="assert 'meshfuse._torch_ops' not in sys.modules\n")
    assert "was built for torch" in warnings and "this is torch 0.0.1" in warnings


@_built
def test_a_record_that_disagrees_with_the_extension_is_not_trusted():
    # _torch_build.py names the torch of the .so beside it; one that names another (a build that
    # stopped between the two) falls back with a warning.
    warnings = _import_on_the_dlpack_path(
        "record = types.ModuleType('meshfuse._torch_build')\n"
        "record.TORCH_VERSION = torch.__version__ = '0.0.2'\n"
        "sys.modules['meshfuse._torch_build'] = record\n")
    assert "is a build for torch" in warnings and "beside a record of 0.0.2" in warnings


@_built
def test_meshfuse_torch_ops_0_turns_the_extension_off():
    code = ("import meshfuse.torch as mt, torch\n"
            "assert not mt.has_torch_extension()\n"
            "x = torch.randn(3, 8)\n"
            "torch.testing.assert_close(mt.softmax(x), torch.softmax(x, -1))\n")
    env = dict(os.environ, MESHFUSE_TORCH_OPS="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
