"""The Python bindings on NumPy arrays: values against NumPy formulas, errors, backend forcing."""

import os
import platform
import subprocess
import sys
import threading

import numpy as np
import pytest

import meshfuse


def randn(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_swiglu_matches_numpy_and_accepts_a_transposed_input():
    gate, up = randn(6, 40, seed=1), randn(6, 40, seed=2)
    out = np.empty_like(gate)
    meshfuse.swiglu(gate, up, out)
    np.testing.assert_allclose(out, up * gate / (1 + np.exp(-gate)), rtol=1e-5, atol=1e-6)
    out_t = np.empty((40, 6), np.float32)
    meshfuse.swiglu(gate.T, up.T, out_t)
    np.testing.assert_array_equal(out_t, out.T)


def test_add_and_mul_match_numpy_in_place_and_on_a_transposed_input():
    a, b = randn(6, 40, seed=30), randn(40, 6, seed=31).T
    out = np.empty_like(a)
    meshfuse.add(a, b, out, alpha=-2.0)  # -2 * b is exact: one rounding, as NumPy's
    np.testing.assert_array_equal(out, a - 2 * b)
    meshfuse.mul(a, 0.5, out)
    np.testing.assert_array_equal(out, a * np.float32(0.5))
    acc = a.copy()
    meshfuse.add(acc, b, acc)  # in place: gradient accumulation
    np.testing.assert_array_equal(acc, a + b)
    x = randn(20, seed=32)
    with pytest.raises(meshfuse.Error, match=r"add: output 'out'.*overlaps 'a'"):
        meshfuse.add(x[1:17], x[1:17], x[:16])
    # Every op's output, not only add's: softmax of rows 0..3 into rows 1..4 of one buffer.
    buf = randn(5, 6, seed=33)
    with pytest.raises(ValueError, match=r"softmax: output 'y'.*overlaps 'x'"):
        meshfuse.softmax(buf[:4], buf[1:])
    with pytest.raises(meshfuse.Error, match=r"mul: 'out' must have shape \[6, 40\], got \[40, "):
        meshfuse.mul(a, 2.0, np.empty((40, 6), np.float32))


def test_add_and_mul_equal_torch_bitwise_on_the_cpu():
    # What elementwise.h claims against torch's CPU kernels: f32 and f64 add (an fma, alpha 0.1
    # too) and every mul bitwise, on contiguous, transposed and in-place operands; 16-bit add
    # bitwise for alpha * b exact, and otherwise torch's fp32 add rounded once to the dtype.
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(40)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        sixteen = dtype in (torch.bfloat16, torch.float16)
        a = torch.randn(33, 70, generator=g).to(dtype)
        for b in (torch.randn(33, 70, generator=g).to(dtype),
                  torch.randn(70, 33, generator=g).to(dtype).T):
            for alpha in (1.0, -2.0, 0.5, 0.1):
                out = torch.empty_like(a)
                meshfuse.add(a, b, out, alpha=alpha)
                if sixteen and alpha == 0.1:
                    expected = torch.add(a.float(), b.float(), alpha=alpha).to(dtype)
                else:
                    expected = torch.add(a, b, alpha=alpha)
                assert torch.equal(out, expected), (dtype, alpha, b.stride())
            acc = a.clone()
            meshfuse.add(acc, b, acc, alpha=0.1 if not sixteen else 1.0)
            assert torch.equal(acc, a.add(b, alpha=0.1 if not sixteen else 1.0)), dtype
            for x in (a, b):
                for scalar in (0.1, 1 / 3, -4.0):
                    out = torch.empty_like(a)
                    meshfuse.mul(x, scalar, out)
                    assert torch.equal(out, torch.mul(x, scalar)), (dtype, scalar, x.stride())


def test_rmsnorm_matches_numpy_and_returns_rstd():
    x, w = randn(5, 33, dtype=np.float64, seed=3), randn(33, dtype=np.float64, seed=4)
    y, rstd = np.empty_like(x), np.empty(5, np.float64)  # float64 x: a float64 rstd
    meshfuse.rmsnorm(x, w, y, rstd, 1e-5)
    expected_rstd = 1 / np.sqrt((x * x).mean(-1) + 1e-5)
    np.testing.assert_allclose(y, x * expected_rstd[:, None] * w, rtol=1e-12)
    np.testing.assert_allclose(rstd, expected_rstd, rtol=1e-12)
    with pytest.raises(TypeError, match="'rstd' must be f64, got f32"):
        meshfuse.rmsnorm(x, w, y, np.empty(5, np.float32), 1e-5)


def test_softmax_rows_sum_to_one_and_all_minus_inf_rows_give_nan():
    x = randn(3, 1000, seed=5)
    x[2] = -np.inf
    y = np.empty_like(x)
    meshfuse.softmax(x, y)
    np.testing.assert_allclose(y[:2].sum(-1), 1.0, rtol=1e-5)
    assert np.isnan(y[2]).all()


def test_empty_numpy_outputs_are_taken_whatever_their_strides():
    # NumPy gives an empty array's dims stride 0: these were refused as not contiguous.
    x = np.empty((0, 7), np.float32)
    assert x.strides == (0, 0) or x.strides == (28, 4)
    for y in (np.empty_like(x), np.lib.stride_tricks.as_strided(np.empty(1, np.float32), (0, 7), (0, 0))):
        meshfuse.softmax(x, y)
        meshfuse.rmsnorm(x, np.ones(7, np.float32), y, None, 1e-5)


def test_an_output_over_an_input_is_refused_where_the_op_cannot_write_in_place():
    # r over residual gave a wrong y (the kernel reads residual again after writing r).
    x, residual = np.ones((5, 8), np.float32), np.full((5, 8), 2.0, np.float32)
    y, rstd = np.empty_like(x), np.empty(5, np.float32)
    with pytest.raises(ValueError, match="output 'r' .* is the same memory as 'residual'"):
        meshfuse.fused_residual_add_rmsnorm(x, residual, None, y, residual, rstd, 1e-5, 0.5)
    meshfuse.fused_residual_add_rmsnorm(x, residual, None, residual, y, rstd, 1e-5, 0.5)  # y over it
    np.testing.assert_allclose(residual, 1.0, rtol=1e-6)  # 0.5 + 2 = 2.5 in every element
    np.testing.assert_array_equal(y, 2.5)


def test_option_errors_name_the_op_that_was_called():
    x, w = np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)
    labels, loss = np.zeros(2, np.int64), np.empty((), np.float32)
    with pytest.raises(ValueError, match="^.*fused_linear_cross_entropy: reduction: unknown name"):
        meshfuse.fused_linear_cross_entropy(x, w, None, labels, None, loss, None, None, None,
                                            reduction="batchmean")
    with pytest.raises(ValueError, match="swiglu_packed_backward: layout must be"):
        meshfuse.swiglu_packed_backward(np.ones((2, 2), np.float32), x, "pairs", np.empty_like(x))


def test_cross_entropy_mean_skips_ignored_rows():
    logits = randn(4, 11, dtype=np.float64, seed=6)
    labels = np.array([3, -100, 10, 0], dtype=np.int64)
    loss, lse = np.empty((), np.float64), np.empty(4, np.float64)
    meshfuse.cross_entropy(logits, labels, loss, lse)
    ref_lse = np.log(np.exp(logits).sum(-1))
    kept = [0, 2, 3]
    expected = np.mean([ref_lse[i] - logits[i, labels[i]] for i in kept])
    np.testing.assert_allclose(loss, expected, rtol=1e-12)
    # lse=None: inference's call, the same loss with nothing else written.
    alone = np.empty((), np.float64)
    meshfuse.cross_entropy(logits, labels, alone, None)
    assert alone == loss


def test_cross_entropy_on_vocabulary_shards_combines_into_the_whole_vocabulary():
    logits = randn(5, 11, dtype=np.float64, seed=8)
    labels = np.array([3, -100, 10, 0, 7], dtype=np.int64)
    loss, lse = np.empty(5), np.empty(5)
    meshfuse.cross_entropy(logits, labels, loss, lse, reduction="none")
    grad = np.empty_like(logits)
    meshfuse.cross_entropy_backward(np.ones(5), logits, labels, lse, grad, reduction="none")
    shard_lse, linear = [], np.zeros(5)
    for start, stop in [(0, 4), (4, 11)]:
        part = np.ascontiguousarray(logits[:, start:stop])
        part_loss, part_lse = np.empty(5), np.empty(5)
        meshfuse.cross_entropy(part, labels, part_loss, part_lse, reduction="none",
                               vocab_start=start, vocab_size=11)
        shard_lse.append(part_lse)
        linear += part_lse - part_loss
        part_grad = np.empty_like(part)
        meshfuse.cross_entropy_backward(np.ones(5), part, labels, lse, part_grad,
                                        reduction="none", vocab_start=start, vocab_size=11)
        np.testing.assert_allclose(part_grad, grad[:, start:stop], rtol=1e-12, atol=1e-15)
    kept = labels != -100
    combined = np.logaddexp(*shard_lse)
    np.testing.assert_allclose(combined[kept], lse[kept], rtol=1e-12)
    np.testing.assert_allclose((combined - linear)[kept], loss[kept], rtol=1e-12)


def test_bad_input_raises_meshfuse_error_naming_op_and_argument():
    gate, up = randn(2, 8), randn(2, 9)
    with pytest.raises(meshfuse.Error, match=r"swiglu.*'up'.*\[2, 8\].*\[2, 9\]"):
        meshfuse.swiglu(gate, up, np.empty_like(gate))
    labels = np.array([0, 11], dtype=np.int64)
    with pytest.raises(meshfuse.Error, match=r"cross_entropy.*labels\[1\] = 11.*\[0, 11\)"):
        meshfuse.cross_entropy(randn(2, 11), labels, np.empty((), np.float32),
                               np.empty(2, np.float64))


def test_uint32_arrays_pass_both_ways_and_serve_as_cu_seqlens_like_int32():
    # uint32 (DLPack kDLUInt, 32 bits) as input, output and cu_seqlens; values past 2^31 keep
    # their bits.
    x = np.array([[2**31, 2, 3], [2**32 - 1, 5, 6]], np.uint32)[..., None]  # (B, S, 1)
    for index_dtype in (np.int32, np.uint32):
        cu = np.array([0, 2, 3], index_dtype)
        packed = np.empty((3, 1), np.uint32)
        meshfuse.pack_sequence(x, cu, packed, padding_side="right")
        np.testing.assert_array_equal(packed[:, 0], [2**31, 2, 2**32 - 1])
        padded = np.full_like(x, 7)
        meshfuse.unpack_sequence(packed, cu, padded, padding_side="right")
        np.testing.assert_array_equal(padded[..., 0], [[2**31, 2, 0], [2**32 - 1, 0, 0]])
    with pytest.raises(meshfuse.Error, match=r"softmax: 'x' must be .*, got u32"):
        meshfuse.softmax(x[..., 0], np.empty_like(x[..., 0]))


def test_forced_backend_nests_restores_and_rejects_unknown_names():
    assert meshfuse.forced_kernel_backend() is None
    with meshfuse.force_kernel_backend("reference"):
        assert meshfuse.forced_kernel_backend() == "reference"
        with meshfuse.force_kernel_backend("cpu"):
            assert meshfuse.forced_kernel_backend() == "cpu"
        assert meshfuse.forced_kernel_backend() == "reference"
        gate = randn(3, 8)
        out = np.empty_like(gate)
        meshfuse.swiglu(gate, gate, out)
    assert meshfuse.forced_kernel_backend() is None
    with pytest.raises(meshfuse.Error, match="kernel backend.*'tpu'"):
        meshfuse.force_kernel_backend("tpu")


def test_forced_backend_exit_out_of_turn_raises_instead_of_crashing():
    scope = meshfuse.force_kernel_backend("reference")
    with pytest.raises(ValueError, match="__exit__ without a matching __enter__"):
        scope.__exit__(None, None, None)  # popped an empty stack: a segfault
    scope.__enter__()
    errors = []

    def exit_elsewhere():
        try:
            scope.__exit__(None, None, None)
        except ValueError as e:
            errors.append(str(e))

    thread = threading.Thread(target=exit_elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "another thread" in errors[0]
    assert meshfuse.forced_kernel_backend() == "reference"  # still this thread's
    scope.__exit__(None, None, None)
    assert meshfuse.forced_kernel_backend() is None


def test_registered_kernels_list_every_op_on_reference_and_cpu():
    kernels = {(op, backend) for op, backend, _, _ in meshfuse.registered_kernels()}
    for op in ["swiglu", "rmsnorm", "softmax", "cross_entropy", "linear",
               "fused_linear_cross_entropy"]:
        assert (op, "reference") in kernels and (op, "cpu") in kernels


def test_gemm_with_transposes_alpha_and_beta_matches_numpy():
    a, b, c = randn(5, 7, dtype=np.float64, seed=10), randn(4, 7, dtype=np.float64, seed=11), \
        randn(5, 4, dtype=np.float64, seed=12)
    d = np.empty((5, 4))
    meshfuse.gemm(a, b, c, d, transpose_b=True, alpha=0.5, beta=2.0)
    np.testing.assert_allclose(d, 0.5 * a @ b.T + 2.0 * c, rtol=1e-12)


def test_float16_operands_take_a_float32_output_holding_the_fp32_sums_unrounded():
    # Integers in [-64, 64) with K = 257: exact sums of up to 21 bits, past float16's 11.
    rng = np.random.default_rng(19)
    a = rng.integers(-64, 64, (6, 257)).astype(np.float16)
    b = rng.integers(-64, 64, (257, 5)).astype(np.float16)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert (exact.astype(np.float16).astype(np.float64) != exact).any()  # f16 d would fail
    d = np.empty((6, 5), dtype=np.float32)
    meshfuse.gemm(a, b, None, d)
    np.testing.assert_array_equal(d, exact)
    out = np.empty((6, 5), dtype=np.float32)
    bias = np.full(5, 0.25, dtype=np.float16)
    meshfuse.linear(a, np.ascontiguousarray(b.T), bias, out)
    np.testing.assert_array_equal(out, exact + 0.25)
    with pytest.raises(meshfuse.DTypeMismatchError, match=r"gemm: 'd' must have the dtype of 'a' "
                       r"\(f16\) or f32, got f64"):
        meshfuse.gemm(a, b, None, np.empty((6, 5)))


def test_linear_and_its_backward_match_numpy():
    x, w, bias = randn(2, 3, 8, dtype=np.float64, seed=13), randn(5, 8, dtype=np.float64, seed=14), \
        randn(5, dtype=np.float64, seed=15)
    out = np.empty((2, 3, 5))
    meshfuse.linear(x, w, bias, out)
    np.testing.assert_allclose(out, x @ w.T + bias, rtol=1e-12)
    dy = randn(2, 3, 5, dtype=np.float64, seed=16)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(bias)
    meshfuse.linear_backward(dy, x, w, dx, dw, db)
    np.testing.assert_allclose(dx, dy @ w, rtol=1e-12)
    np.testing.assert_allclose(dw, dy.reshape(-1, 5).T @ x.reshape(-1, 8), rtol=1e-12)
    np.testing.assert_allclose(db, dy.reshape(-1, 5).sum(0), rtol=1e-12)


def test_fused_linear_cross_entropy_equals_linear_then_cross_entropy():
    x, w = randn(6, 8, dtype=np.float64, seed=17), randn(11, 8, dtype=np.float64, seed=18)
    labels = np.array([1, -100, 10, 0, 3, 3], dtype=np.int64)
    loss, grad_x, grad_w = np.empty(()), np.empty_like(x), np.empty_like(w)
    meshfuse.fused_linear_cross_entropy(x, w, None, labels, np.ones(()), loss, grad_x, grad_w,
                                        None, chunk_rows=4)
    logits = x @ w.T
    expected, lse = np.empty(()), np.empty(6)
    meshfuse.cross_entropy(logits, labels, expected, lse)
    np.testing.assert_allclose(loss, expected, rtol=1e-12)
    dlogits = np.empty_like(logits)
    meshfuse.cross_entropy_backward(np.ones(()), logits, labels, lse, dlogits)
    np.testing.assert_allclose(grad_x, dlogits @ w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad_w, dlogits.T @ x, rtol=1e-10, atol=1e-12)


def test_fused_linear_cross_entropy_takes_f32_parameter_gradients_of_f16_inputs():
    # Many chunks (chunk_rows=2 over 16 rows): the f32 grad_weight and grad_bias accumulate in
    # fp32, so they match the float64 composition to fp32 accuracy.
    x, w = randn(16, 8, dtype=np.float16, seed=19), randn(11, 8, dtype=np.float16, seed=20)
    bias = randn(11, dtype=np.float16, seed=21)
    labels = np.random.default_rng(22).integers(0, 11, 16)
    loss, grad_w, grad_b = np.empty((), np.float16), np.empty((11, 8), np.float32), \
        np.empty(11, np.float32)
    meshfuse.fused_linear_cross_entropy(x, w, bias, labels, np.ones((), np.float16), loss, None,
                                        grad_w, grad_b, reduction="sum", chunk_rows=2)
    logits = x.astype(np.float64) @ w.astype(np.float64).T + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(16), labels] -= 1
    np.testing.assert_allclose(grad_w, p.T @ x.astype(np.float64), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad_b, p.sum(0), rtol=1e-4, atol=1e-5)
    with pytest.raises(meshfuse.Error, match="'grad_weight'.*f16.*or f32.*got f64"):
        meshfuse.fused_linear_cross_entropy(x, w, bias, labels, np.ones((), np.float16), loss,
                                            None, np.empty((11, 8)), None)


def test_memory_stats_are_for_cuda_devices_only():
    with pytest.raises(meshfuse.Error, match="CUDA devices only"):
        meshfuse.device_memory_stats("cpu")
    with pytest.raises(meshfuse.Error, match="reset_peak_memory_stats"):
        meshfuse.reset_peak_memory_stats("cpu")
    with pytest.raises(meshfuse.Error, match="empty_cache"):
        meshfuse.empty_cache("cpu")


def _cpu_blas_in_a_fresh_process(env_update):
    """What meshfuse.cpu_blas_library() and an f32 linear say in a new interpreter whose
    environment has `env_update` (the choice is made once per process)."""
    code = (
        "import numpy as np, meshfuse\n"
        "try:\n"
        "    meshfuse.linear(np.ones((2, 3), np.float32), np.ones((4, 3), np.float32), None,\n"
        "                    np.empty((2, 4), np.float32))\n"
        "    print('ok', meshfuse.cpu_blas_library())\n"
        "except meshfuse.Error as e:\n"
        "    print(type(e).__name__, e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFUSE_")}
    env.update(env_update)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MKL is x86-64 only")
def test_cpu_blas_is_chosen_by_MESHFUSE_CPU_BLAS():
    assert _cpu_blas_in_a_fresh_process({"MESHFUSE_CPU_BLAS": "onednn"}).startswith("ok oneDNN ")
    out = _cpu_blas_in_a_fresh_process({"MESHFUSE_CPU_BLAS": "openblas"})
    assert out.startswith("InvalidArgumentError") and "MESHFUSE_CPU_BLAS" in out, out
    assert "unknown name 'openblas' (expected one of mkl, onednn)" in out, out
    missing = "/nonexistent/libmkl_rt.so.3"
    for pin in ({"MESHFUSE_CPU_BLAS": "MKL"}, {}):  # a file named pins MKL too
        out = _cpu_blas_in_a_fresh_process({**pin, "MESHFUSE_MKL_LIBRARY": missing})
        assert out.startswith("BackendUnavailableError"), out
        assert f"cannot load {missing}, the file MESHFUSE_MKL_LIBRARY names" in out, out
    # Unset, MKL where it opens (as pinned), else oneDNN.
    default = _cpu_blas_in_a_fresh_process({})
    pinned = _cpu_blas_in_a_fresh_process({"MESHFUSE_CPU_BLAS": "mkl"})
    if pinned.startswith("ok "):
        assert default == pinned and default.startswith("ok Intel MKL "), (default, pinned)
        assert default.endswith(", GNU OpenMP threads"), default
        if os.path.exists(os.path.join(sys.prefix, "lib", "libmkl_rt.so.3")):
            # PyPI's MKL, opened by the package at import: found by its soname, not by the path
            # baked in at build time, so a wheel built elsewhere finds it too.
            assert "(libmkl_rt.so.3)" in default, default
        chosen = _cpu_blas_in_a_fresh_process({"MKL_THREADING_LAYER": "sequential"})
        assert chosen.endswith(", threads as MKL_THREADING_LAYER=sequential"), chosen
    else:
        assert default.startswith("ok oneDNN "), default


def test_f32_linear_is_as_accurate_as_pytorch_on_mkl():
    if not meshfuse.cpu_blas_library().startswith("Intel MKL"):
        pytest.skip("the cpu GEMMs run on oneDNN here (pip install mkl for MKL)")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    for m, n, k, with_bias in ((16, 512, 4096, False), (97, 300, 1030, False),
                               (16, 512, 4096, True)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32) if with_bias else None
        exact = x.astype(np.float64) @ w.astype(np.float64).T + (b if with_bias else 0.0)
        out = np.empty((m, n), np.float32)
        meshfuse.linear(x, w, b, out)
        theirs = torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w),
                                            None if b is None else torch.from_numpy(b)).numpy()
        # MKL's sums are PyTorch's: its error, give or take the bias's rounding and MKL's
        # version (on oneDNN, 1.3-1.6x at these K).
        ours_error, theirs_error = np.abs(out - exact).max(), np.abs(theirs - exact).max()
        assert ours_error <= 1.1 * theirs_error, (m, n, k, with_bias, ours_error, theirs_error)


def test_cublaslt_library_is_opened_at_run_time_in_cuda_builds():
    if not meshfuse.built_with_cuda():
        with pytest.raises(meshfuse.Error, match="no CUDA support"):
            meshfuse.cublaslt_library()
        return
    library = meshfuse.cublaslt_library()  # no GPU needed
    assert library.startswith("cuBLASLt ") and "libcublasLt" in library
