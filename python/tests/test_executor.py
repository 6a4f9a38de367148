"""The multi-device executor from Python: Program, DeviceMesh, placements, MultiDeviceExecutor and
grad on 4 ranks as threads (the local backend) and on 4 gloo processes, against NumPy and against
the same program run whole on one rank."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import meshfuse
from meshfuse import DeviceMesh, Partial, Replicate, Shard

# A rank that fails stops the others at their next collective within this many seconds.
TIMEOUT = 30


def randn(*shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def on_ranks(n, fn):
    """fn(comm) on n local ranks; returns {rank: what fn returned}."""
    results = {}

    def rank_fn(comm):
        results[comm.rank] = fn(comm)

    meshfuse.run_local(n, rank_fn, timeout=TIMEOUT)
    return results


def all_gather_matmul(m, k, n, ranks):
    """nvFuser's all-gather + matmul: x split by rows over the ranks, w whole, the product wanted
    whole on every rank."""
    with meshfuse.Program() as p:
        x = p.define_tensor("x", [m, k], "f32")
        w = p.define_tensor("w", [k, n], np.float32)
        p.set_mesh(DeviceMesh.of_shape([ranks]))
        p.set_placements(x, [Shard(0)])
        p.set_placements(w, [Replicate()])
        p.add_output(p.matmul(x, w), [Replicate()])
    return p


def test_all_gather_matmul_on_four_local_ranks_matches_numpy():
    m = k = n = 1024
    p = all_gather_matmul(m, k, n, 4)
    x, w = randn(m, k, seed=1), randn(k, n, seed=2)

    def rank_fn(comm):
        executor = meshfuse.MultiDeviceExecutor(p, comm)
        part = meshfuse.shard_tensor(x, p.mesh, [Shard(0)], comm.rank)
        (out,) = executor.run([part, w])
        return out, str(executor.plan())

    results = on_ranks(4, rank_fn)
    expected = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(expected).max()
    for rank, (out, plan) in results.items():
        assert "all_gather" in plan and "on local" in plan, plan
        assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (m, n)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * scale)
        # Replicate: every rank holds the same whole product.
        np.testing.assert_array_equal(out, results[0][0])


def mlp_block(mesh=None):
    """A llama-style MLP block, tensor- and sequence-parallel on a 1-D mesh (Megatron-LM's layout),
    as tests/executor_cases.h builds it but smaller; 6 tokens and 10 intermediate features are
    uneven over 4 ranks."""
    tokens, hidden, inter = 6, 8, 10
    p = meshfuse.Program()
    x = p.define_tensor("x", [tokens, hidden], "f32")
    norm = p.define_tensor("norm_weight", [hidden], "f32")
    gate = p.define_tensor("gate_weight", [inter, hidden], "f32")
    up = p.define_tensor("up_weight", [inter, hidden], "f32")
    down = p.define_tensor("down_weight", [hidden, inter], "f32")
    h = p.rmsnorm(x, norm, 1e-5)
    a = p.swiglu(p.linear(h, gate), p.linear(h, up))
    y = p.add(x, p.linear(a, down))
    if mesh is None:
        p.add_output(y)
    else:
        p.set_mesh(mesh)
        p.set_placements(x, Shard(0))
        p.set_placements(gate, Shard(0))
        p.set_placements(up, Shard(0))
        p.set_placements(down, Shard(1))
        p.add_output(y, Shard(0))
    return meshfuse.grad(p, y, p.inputs)


def test_mlp_block_forward_and_backward_on_four_ranks_match_one_device():
    single, sharded = mlp_block(), mlp_block(DeviceMesh.of_shape([4]))
    assert [v.name for v in sharded.inputs][-1] == "grad_loss"
    inputs = {v.name: randn(*v.shape, seed=10 + i) for i, v in enumerate(single.inputs)}
    one_rank = meshfuse.LocalWorld(1).communicator(0)
    expected = meshfuse.MultiDeviceExecutor(single, one_rank).run(inputs)
    assert len(expected) == 6  # y, then the gradients of the five inputs

    def rank_fn(comm):
        executor = meshfuse.MultiDeviceExecutor(sharded, comm)
        parts = {v.name: meshfuse.shard_tensor(inputs[v.name], sharded.mesh,
                                               sharded.placements(v) or [Replicate()], comm.rank)
                 for v in sharded.inputs}
        plan = executor.plan()
        outputs = executor.run(parts)
        gathered = [meshfuse.gather_tensor(out, v.shape, sharded.mesh, placements, comm)
                    for out, v, placements in zip(outputs, sharded.outputs,
                                                  plan.output_placements)]
        return gathered, str(plan)

    for rank, (gathered, plan) in on_ranks(4, rank_fn).items():
        # x's gradient goes back to token shards, the norm weight's is summed over them.
        assert "reduce_scatter" in plan and "all_reduce(sum)" in plan, plan
        for i, (ours, theirs) in enumerate(zip(gathered, expected)):
            np.testing.assert_allclose(ours, theirs, rtol=5e-5, atol=5e-5,
                                       err_msg=f"output {i} on rank {rank}")


def test_a_loss_whose_operands_could_split_the_vocabulary_on_two_mesh_dims_splits_it_on_one():
    # The head split on mesh dim 0 and x's hidden dim on dim 1: each dim on its own chose the
    # vocabulary-parallel loss, and the lowering then refused the program it had made.
    def program(mesh=None):
        p = meshfuse.Program()
        x = p.define_tensor("x", [5, 6], "f32")
        head = p.define_tensor("head", [9, 6], "f32")
        labels = p.define_tensor("labels", [5], "i64")
        loss = p.cross_entropy(p.linear(x, head), labels)
        if mesh:
            p.set_mesh(mesh)
            p.set_placements(head, [Shard(0), Replicate()])
            p.set_placements(x, [Replicate(), Shard(1)])
        p.add_output(loss)
        return meshfuse.grad(p, loss, [x, head])

    single, sharded = program(), program(DeviceMesh.of_shape([2, 2]))
    inputs = {"x": randn(5, 6, seed=1), "head": randn(9, 6, seed=2),
              "labels": np.array([0, 8, 3, 4, 7], np.int64), "grad_loss": np.ones((), np.float32)}
    expected = meshfuse.MultiDeviceExecutor(single, meshfuse.LocalWorld(1).communicator(0)).run(inputs)

    def rank_fn(comm):
        executor = meshfuse.MultiDeviceExecutor(sharded, comm)
        plan = executor.plan()
        parts = {v.name: meshfuse.shard_tensor(inputs[v.name], sharded.mesh,
                                               sharded.placements(v) or [Replicate()] * 2,
                                               comm.rank)
                 for v in sharded.inputs}
        return [meshfuse.gather_tensor(out, v.shape, sharded.mesh, placements, comm)
                for out, v, placements in zip(executor.run(parts), sharded.outputs,
                                              plan.output_placements)]

    for rank, gathered in on_ranks(4, rank_fn).items():
        for i, (ours, theirs) in enumerate(zip(gathered, expected)):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6,
                                       err_msg=f"output {i} on rank {rank}")


@pytest.mark.parametrize("overlap,chunks", [("collective", 1), ("collective", 2),
                                            ("collective", 0), ("collective", 8), ("ring", 0)])
def test_overlapped_mlp_block_matches_one_device_and_runs_alike_twice(overlap, chunks):
    """Communication overlapped with the GEMMs, chosen per run through the params: the forward's
    all_gather .. reduce_scatter and the backward's GEMMs .. reduce_scatter in row chunks (8
    chunks of 6 tokens over 4 ranks leave empty ones)."""
    single, sharded = mlp_block(), mlp_block(DeviceMesh.of_shape([4]))
    inputs = {v.name: randn(*v.shape, seed=10 + i) for i, v in enumerate(single.inputs)}
    one_rank = meshfuse.LocalWorld(1).communicator(0)
    expected = meshfuse.MultiDeviceExecutor(single, one_rank).run(inputs)
    params = meshfuse.MultiDeviceExecutorParams(overlap=overlap, chunks=chunks)
    assert params.overlap == overlap and params.chunks == chunks
    assert params.number_of_streams == 2

    def rank_fn(comm):
        executor = meshfuse.MultiDeviceExecutor(sharded, comm, params)
        parts = {v.name: meshfuse.shard_tensor(inputs[v.name], sharded.mesh,
                                               sharded.placements(v) or [Replicate()], comm.rank)
                 for v in sharded.inputs}
        first, second = executor.run(parts), executor.run(parts)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)
        return [meshfuse.gather_tensor(out, v.shape, sharded.mesh, placements, comm)
                for out, v, placements in zip(first, sharded.outputs,
                                              executor.plan().output_placements)]

    for rank, gathered in on_ranks(4, rank_fn).items():
        for i, (ours, theirs) in enumerate(zip(gathered, expected)):
            np.testing.assert_allclose(ours, theirs, rtol=5e-5, atol=5e-5,
                                       err_msg=f"output {i} on rank {rank}")
    with pytest.raises(meshfuse.Error, match=r"overlap: unknown name .pipelined. \(expected one "
                                             r"of none, collective, ring\)"):
        meshfuse.MultiDeviceExecutorParams(overlap="pipelined")
    # Every field is checked when set, not at the first run on every rank.
    with pytest.raises(ValueError, match="chunks must be >= 1, or 0"):
        meshfuse.MultiDeviceExecutorParams(chunks=-3)
    params = meshfuse.MultiDeviceExecutorParams()
    with pytest.raises(ValueError, match="number_of_streams must be >= 1, got 0"):
        params.number_of_streams = 0
    assert params.number_of_streams == 2


def test_the_params_backend_names_the_plans_communications_and_each_plan_is_cached():
    world = meshfuse.LocalWorld(4)
    p = meshfuse.Program()
    x = p.define_tensor("x", [10, 4], "f32")
    p.set_mesh(DeviceMesh.of_shape([4]))
    p.set_placements(x, Shard(0))
    p.add_output(x, Replicate())
    # Lowering needs no peers: one rank's executor plans alone.
    executor = meshfuse.MultiDeviceExecutor(p, world.communicator(2))
    assert executor.params == meshfuse.MultiDeviceExecutorParams()
    assert executor.params.communicator_backend is None
    plan = executor.plan()
    assert plan.backend == meshfuse.CommunicatorBackend.local and plan.rank == 2
    assert plan.communications == [
        "all_gather(dim 0) on local, mesh dim 0, team [0 1 2 3], sizes [3 3 2 2]"]
    assert plan.input_shapes == [(2, 4)] and plan.output_shapes == [(10, 4)]
    assert executor.cached_plans == 1

    params = executor.params  # a copy: changed, then assigned back
    params.communicator_backend = "gloo"
    assert params.communicator_backend == meshfuse.CommunicatorBackend.gloo
    executor.params = params
    assert "all_gather(dim 0) on gloo" in str(executor.plan())
    assert executor.cached_plans == 2
    executor.params = meshfuse.MultiDeviceExecutorParams(meshfuse.CommunicatorBackend.mpi)
    assert executor.plan().communications[0].startswith("all_gather(dim 0) on mpi")
    assert executor.cached_plans == 3
    executor.params = meshfuse.MultiDeviceExecutorParams()
    assert "on local" in str(executor.plan()) and executor.cached_plans == 3
    with pytest.raises(meshfuse.Error, match="gloo"):
        meshfuse.MultiDeviceExecutorParams("tcp")


def test_errors_name_the_mesh_the_rank_and_the_input():
    def rank_fn(comm):
        small = meshfuse.Program()
        small.add_output(small.define_tensor("t", [6, 4], "f32"))
        small.set_mesh(DeviceMesh([0]))
        with pytest.raises(meshfuse.Error, match="laid over"):
            meshfuse.MultiDeviceExecutor(small, comm)
        with pytest.raises(meshfuse.Error, match="rank 5"):
            meshfuse.shard_tensor(np.zeros((6, 4), np.float32), DeviceMesh.of_shape([4]),
                                  Shard(0), 5)

        p = meshfuse.Program()
        x = p.define_tensor("x", [10, 4], "f32")
        p.set_mesh(DeviceMesh.of_shape([comm.size]))
        p.set_placements(x, Shard(0))
        p.add_output(x, Replicate())
        executor = meshfuse.MultiDeviceExecutor(p, comm)
        (part,) = executor.plan().input_shapes
        # Every rank refuses its input before any collective, so none waits for the others.
        with pytest.raises(meshfuse.Error, match=rf"input %0 'x'.*must be \[{part[0]}, 4\]"):
            executor.run([np.zeros((part[0] + 1, 4), np.float32)])
        with pytest.raises(meshfuse.Error, match="'x'.*must be f32"):
            executor.run({"x": np.zeros(part, np.float64)})
        with pytest.raises(meshfuse.Error,
                           match="no array for input %0 'x' .*; given, not inputs: 'y'"):
            executor.run({"y": np.zeros(part, np.float32)})
        with pytest.raises(meshfuse.Error, match="2 arrays given by name, the program's inputs "
                                                 "are 'x'; given, not inputs: 'bias'"):
            executor.run({"x": np.zeros(part, np.float32), "bias": np.zeros(4, np.float32)})
        with pytest.raises(meshfuse.Error, match="a list of arrays"):
            executor.run(np.zeros(part, np.float32))
        return True

    assert on_ranks(4, rank_fn) == {r: True for r in range(4)}


@pytest.mark.parametrize("options", [{}, {"z_loss_scale": 1e-2}, {"label_smoothing": 0.1},
                                     {"label_smoothing": 1.0}])
@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_a_vocabulary_shard_masked_to_minus_inf_gives_the_one_device_loss(op, options):
    """A padded vocabulary's masked columns (-inf logits, or a -inf bias) filling one rank's shard:
    that shard's lse and loss were -inf, their difference NaN, and every row's loss NaN. Row 2's
    label is a masked column (+inf, as on one device); with label smoothing every row is +inf, and
    at label smoothing 1 row 2 is NaN (0 x -inf), as on one device."""
    n, h, v = 3, 5, 8
    xs, w = randn(n, h, seed=1), randn(v, h, seed=2)
    bias = np.where(np.arange(v) >= 4, -np.inf, 0).astype(np.float32)  # shard 1: columns 4..7
    labels = np.array([0, 2, 6], np.int64)

    def program(mesh):
        p = meshfuse.Program()
        if op == "cross_entropy":
            x = p.define_tensor("x", [n, v], "f32")
            weight = None
        else:
            x = p.define_tensor("x", [n, h], "f32")
            weight, b = p.define_tensor("w", [v, h], "f32"), p.define_tensor("b", [v], "f32")
        y = p.define_tensor("labels", [n], "i64")
        for reduction in ["none", "sum"]:
            if weight is None:
                p.add_output(p.cross_entropy(x, y, reduction=reduction, **options))
            else:
                p.add_output(p.fused_linear_cross_entropy(x, weight, b, y,
                                                          reduction=reduction, **options))
        if mesh:
            p.set_mesh(mesh)
            if weight is None:
                p.set_placements(x, Shard(1))
            else:
                p.set_placements(weight, Shard(0))
                p.set_placements(b, Shard(0))
        return p

    logits = xs @ w.T + bias
    inputs = ({"x": logits, "labels": labels} if op == "cross_entropy"
              else {"x": xs, "w": w, "b": bias, "labels": labels})
    one = meshfuse.MultiDeviceExecutor(program(None), meshfuse.LocalWorld(1).communicator(0))
    expected = [np.asarray(t) for t in one.run(inputs)]
    finite = [np.isfinite(expected[0][i]) for i in range(n)]
    assert finite == ([True, True, False] if not options.get("label_smoothing") else [False] * 3)
    sharded = program(DeviceMesh.of_shape([2]))

    def rank_fn(comm):
        executor = meshfuse.MultiDeviceExecutor(sharded, comm)
        parts = {t.name: meshfuse.shard_tensor(inputs[t.name], sharded.mesh,
                                               sharded.placements(t) or [Replicate()], comm.rank)
                 for t in sharded.inputs}
        return [np.asarray(t) for t in executor.run(parts)]

    for rank, got in on_ranks(2, rank_fn).items():
        for ours, theirs in zip(got, expected):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, err_msg=f"rank {rank}")


def test_a_bad_label_of_a_vocabulary_parallel_fused_loss_names_the_op_and_its_row():
    # It named cross_entropy (the kernel run on each chunk of the shard) and the row in the chunk.
    n, h, v = 6, 4, 5
    p = meshfuse.Program()
    x, w = p.define_tensor("x", [n, h], "f32"), p.define_tensor("w", [v, h], "f32")
    y = p.define_tensor("labels", [n], "i64")
    p.add_output(p.fused_linear_cross_entropy(x, w, None, y))
    p.set_mesh(DeviceMesh.of_shape([2]))
    p.set_placements(w, Shard(0))
    labels = np.arange(n) % v
    labels[4] = 7

    def rank_fn(comm):
        executor = meshfuse.MultiDeviceExecutor(p, comm)
        part = meshfuse.shard_tensor(randn(v, h, seed=2), p.mesh, Shard(0), comm.rank)
        with pytest.raises(ValueError, match=r"fused_linear_cross_entropy: labels\[4\] = 7 is "
                                             r"outside \[0, 5\)"):
            executor.run({"x": randn(n, h, seed=1), "w": part, "labels": labels})

    on_ranks(2, rank_fn)


def test_set_params_on_one_rank_only_is_named_where_the_ranks_compare_params():
    # Rank 0's comparison of params met rank 1's all_gather of the run, and the error called it
    # "the first local communication of cpu tensors".
    p = meshfuse.Program()
    x = p.define_tensor("x", [8, 4], "f32")
    p.set_mesh(DeviceMesh.of_shape([2]))
    p.set_placements(x, Shard(0))
    p.add_output(x, Replicate())
    errors = {}

    def rank_fn(comm):
        executor = meshfuse.MultiDeviceExecutor(p, comm)
        part = np.full((4, 4), comm.rank, np.float32)
        np.testing.assert_array_equal(executor.run({"x": part})[0][4:], 1)
        if comm.rank == 0:
            executor.params = meshfuse.MultiDeviceExecutorParams(overlap="collective")
        with pytest.raises(meshfuse.Error) as e:
            executor.run({"x": part})
        errors[comm.rank] = str(e.value)

    meshfuse.run_local(2, rank_fn, timeout=TIMEOUT)
    assert "after set_params() on this rank (does every rank call it" in errors[0]
    assert "rank 0 has all_gather i64 x 2 but rank 1 has all_gather f32" in errors[0]
    assert "ranks disagree" in errors[1]


def test_a_run_that_fails_on_one_rank_fails_the_others_instead_of_pairing_runs():
    # A bad label (or a bad input) on rank 1 only: its run stopped before the loss's collectives,
    # and the others' run 0 paired with its run 1, returning a loss that mixed two batches.
    t, h, v = 6, 4, 5
    p = meshfuse.Program()
    x = p.define_tensor("x", [t, h], "f32")
    w = p.define_tensor("w", [v, h], "f32")
    labels = p.define_tensor("labels", [t], "i64")
    p.add_output(p.cross_entropy(p.linear(x, w), labels, reduction="sum"))
    p.set_mesh(DeviceMesh.of_shape([3]))
    p.set_placements(x, Shard(0))
    p.set_placements(labels, Shard(0))
    xs, ws = randn(t, h, seed=1), randn(v, h, seed=2)

    def rank_fn(comm, bad):
        executor = meshfuse.MultiDeviceExecutor(p, comm)
        part = meshfuse.shard_tensor(xs, p.mesh, Shard(0), comm.rank)
        mine = meshfuse.shard_tensor(np.arange(t, dtype=np.int64) % v, p.mesh, Shard(0), comm.rank)
        outcomes = []
        for step in range(2):  # rank 1's first run fails; its second is in step no more
            inputs = {"x": part, "w": ws, "labels": mine.copy()}
            if comm.rank == 1 and step == 0:
                if bad == "label":
                    inputs["labels"][0] = 99
                elif bad == "input":
                    inputs["x"] = np.zeros((part.shape[0] + 1, h), np.float32)
                else:  # refused by the binding, before the C++ run
                    del inputs["w"]
            try:
                executor.run(inputs)
                outcomes.append("ran")
            except meshfuse.Error as e:
                outcomes.append(type(e).__name__ + (": out of step" if "out of step" in str(e) else ""))
        return outcomes

    for bad, error in (("label", "InvalidArgumentError"), ("input", "ShapeMismatchError"),
                       ("dict", "InvalidArgumentError")):
        start = time.monotonic()
        results = on_ranks(3, lambda comm: rank_fn(comm, bad))
        assert time.monotonic() - start < TIMEOUT
        out_of_step = "CommunicationError: out of step"
        assert results[0] == results[2] == [out_of_step, out_of_step], (bad, results)
        assert results[1] == [error, out_of_step], (bad, results)


def test_executor_arguments_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="chunks 3: only overlap collective takes chunks"):
        meshfuse.MultiDeviceExecutorParams(overlap="ring", chunks=3)  # chunks were ignored
    p = meshfuse.Program()
    counts = p.define_tensor("counts", [4], "i64")
    p.set_mesh(DeviceMesh.of_shape([2]))
    with pytest.raises(ValueError,
                       match=r"'counts' \[4\] i64: Partial\(avg\) cannot reduce i64 values"):
        p.set_placements(counts, Partial("avg"))  # refused only by the run's all_reduce

    def nccl_on_cpu(comm):
        q = all_gather_matmul(4, 3, 2, 2)
        params = meshfuse.MultiDeviceExecutorParams("nccl")
        executor = meshfuse.MultiDeviceExecutor(q, comm, params)
        # It said "does every rank call run()?" around a CUDA driver error.
        with pytest.raises(meshfuse.BackendUnavailableError, match="nccl cannot serve cpu tensors"):
            executor.run({"x": randn(2, 3, seed=1), "w": randn(3, 2, seed=2)})

    on_ranks(2, nccl_on_cpu)

    def gloo_on_threads(comm):
        q = all_gather_matmul(4, 3, 2, 2)
        executor = meshfuse.MultiDeviceExecutor(q, comm, meshfuse.MultiDeviceExecutorParams("gloo"))
        # It was an InvalidArgumentError asking "does every rank call run()?".
        with pytest.raises(meshfuse.BackendUnavailableError,
                           match="gloo serves the processes of a launched job; this communicator's "
                                 "ranks are threads of a LocalWorld|this build has no gloo"):
            executor.run({"x": randn(2, 3, seed=1), "w": randn(3, 2, seed=2)})

    on_ranks(2, gloo_on_threads)

    def stream_with_cpu_inputs(comm):
        q = all_gather_matmul(4, 3, 2, 2)
        # It named an op of the program (linear), which the caller did not call.
        with pytest.raises(ValueError, match=r"MultiDeviceExecutor.run on rank \d: stream: a native "
                                             r"stream handle \(0x5\) came with inputs on the CPU"):
            meshfuse.MultiDeviceExecutor(q, comm).run(
                {"x": randn(2, 3, seed=1), "w": randn(3, 2, seed=2)}, stream=5)

    on_ranks(2, stream_with_cpu_inputs)


def test_builder_errors_values_and_placements():
    p, q = meshfuse.Program(), meshfuse.Program()
    x = p.define_tensor("x", (4, 8), "bf16")
    y = q.define_tensor("y", (4, 8), "bfloat16")
    assert repr(x) == "<Value %0 'x' [4, 8] bf16>" and x.shape == (4, 8) and x.dtype == "bf16"
    assert x == p.inputs[0] and x != y  # the same id, another program
    with pytest.raises(meshfuse.Error, match="'b'.*is a Value of another Program"):
        p.add(x, y)
    with pytest.raises(meshfuse.Error, match=r"Program.add: 'b'.*must be \[4, 8\]"):
        p.add(x, p.define_tensor("z", [8, 4], "bf16"))
    with pytest.raises(meshfuse.Error, match="dtype must be one of"):
        p.define_tensor("w", [8], "float8")
    y2, r = p.fused_residual_add_rmsnorm(x, x, None, 1e-6)
    assert y2.id == 2 and r.id == 3  # y, r, then the rstd the builder does not return
    p.add_output(p.softmax(y2, logits_multiplier=0.5))
    assert "softmax" in str(p) and p.mesh is None
    labels = p.define_tensor("labels", [4], "i64")
    p.cross_entropy(y2, labels, label_check="device_assert")
    assert "label_check=device_assert" in str(p)
    with pytest.raises(ValueError, match="Program.cross_entropy: label_check: unknown name 'x'"):
        p.cross_entropy(y2, labels, label_check="x")

    mesh = DeviceMesh([3, 1, 0, 2], shape=[2, 2])
    assert mesh.shape == (2, 2) and mesh.ranks == [3, 1, 0, 2] and 3 in mesh and 4 not in mesh
    assert mesh.team(1, 0) == [0, 2] and mesh == DeviceMesh([3, 1, 0, 2], [2, 2])
    assert repr(mesh) == "DeviceMesh([2, 2], ranks [3, 1, 0, 2])"
    assert [repr(pl) for pl in (Shard(-1), Replicate(), Partial(), Partial("max"))] == [
        "Shard(-1)", "Replicate()", "Partial(sum)", "Partial(max)"]
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1) and Shard(0) != Replicate()
    assert Partial().op == "sum" and len({Shard(0), Shard(0), Replicate()}) == 2
    with pytest.raises(meshfuse.Error, match="placements must be Shard, Replicate or Partial"):
        p.set_placements(x, [0])


def test_torch_in_gives_torch_out_and_other_arrays_export_dlpack():
    torch = pytest.importorskip("torch")
    p = meshfuse.Program()
    x = p.define_tensor("x", [5, 8], torch.float32)
    w = p.define_tensor("w", [3, 8], torch.float32)
    b = p.define_tensor("b", [3], torch.float32)
    p.add_output(p.linear(x, w, b))
    executor = meshfuse.MultiDeviceExecutor(p, meshfuse.LocalWorld(1).communicator(0))
    g = torch.Generator().manual_seed(3)
    xs, ws, bs = (torch.randn(*v.shape, generator=g) for v in p.inputs)
    (out,) = executor.run([xs, ws, bs])
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    torch.testing.assert_close(out, torch.nn.functional.linear(xs, ws, bs))
    # Anything else (here a buffer) comes back as a DLPack-exporting ndarray, which NumPy and
    # torch take without a copy; the array keeps the executor's tensor alive.
    (raw,) = executor.run([memoryview(xs.numpy()), ws.numpy(), bs.numpy()])
    as_numpy, as_torch = np.from_dlpack(raw), torch.from_dlpack(raw)
    del raw
    np.testing.assert_array_equal(as_numpy, out.numpy())
    assert as_torch.data_ptr() == as_numpy.ctypes.data


@pytest.mark.skipif(not meshfuse.built_with_cuda() or meshfuse.cuda_device_count() == 0,
                    reason="needs a CUDA build and a GPU")
def test_cuda_inputs_give_outputs_on_their_device():
    torch = pytest.importorskip("torch")
    p = meshfuse.Program()
    x = p.define_tensor("x", [64, 32], torch.bfloat16)
    w = p.define_tensor("w", [32], torch.bfloat16)
    p.add_output(p.rmsnorm(x, w, 1e-6))
    executor = meshfuse.MultiDeviceExecutor(p, meshfuse.LocalWorld(1).communicator(0))
    xs = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    ws = torch.randn(32, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream()
    (out,) = executor.run({"x": xs, "w": ws}, stream=stream.cuda_stream)
    assert out.device == xs.device and out.dtype == torch.bfloat16
    expected = torch.nn.functional.rms_norm(xs.float(), (32,), ws.float(), 1e-6)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


GLOO_RANK = textwrap.dedent("""
    import sys
    import numpy as np
    import meshfuse
    sys.path.insert(0, {tests!r})
    from test_executor import all_gather_matmul, randn
    comm = meshfuse.init_communicator(backend="cpu:gloo", timeout=60)
    m = k = n = 1024
    p = all_gather_matmul(m, k, n, comm.size)
    x, w = randn(m, k, seed=1), randn(k, n, seed=2)
    executor = meshfuse.MultiDeviceExecutor(p, comm)
    (out,) = executor.run([meshfuse.shard_tensor(x, p.mesh, meshfuse.Shard(0), comm.rank), w])
    expected = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    print(comm.rank, executor.plan().communications, flush=True)
""")


def test_all_gather_matmul_on_four_gloo_processes():
    if "gloo" not in meshfuse.communicator_backends():
        pytest.skip("this build has no gloo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = GLOO_RANK.format(tests=os.path.dirname(os.path.abspath(__file__)))
    secret = os.urandom(16).hex()  # the job's store secret, as meshfuse launch makes one
    procs = []
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   MESHFUSE_STORE_SECRET=secret, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=180) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, err
        assert out.strip() == f"{rank} ['all_gather(dim 0) on gloo, mesh dim 0, team [0 1 2 3], " \
                              "sizes [256 256 256 256]']"


def test_a_gather_tensor_refused_on_one_rank_fails_the_others_instead_of_mixing_two_calls():
    # Rank 2's part has the wrong shape at step 0 only. Its refusal was not counted: ranks 0 and 1
    # then gathered step 0's rows with rank 2's step-1 rows, silently.
    mesh = DeviceMesh.of_shape([3])
    steps = [np.zeros((6, 2), np.float32), np.ones((6, 2), np.float32)]

    def rank_fn(comm):
        got = []
        for step, whole in enumerate(steps):
            local = meshfuse.shard_tensor(whole, mesh, Shard(0), comm.rank)
            if comm.rank == 2 and step == 0:
                local = np.zeros((5, 2), np.float32)
            try:
                got.append(meshfuse.gather_tensor(local, [6, 2], mesh, Shard(0), comm))
            except meshfuse.Error as e:
                got.append(type(e).__name__ + ": " + str(e))
        return got

    results = meshfuse.run_local(3, rank_fn, timeout=20)
    assert results[2][0].startswith("ShapeMismatchError") and "gather_tensor" in results[2][0]
    for r in range(3):
        for got in results[r]:
            if not isinstance(got, str):  # any gather that returned gathered one call's rows
                assert np.all(got == got[0, 0]), (r, got)
    assert all("out of step" in results[r][0] for r in (0, 1)), results


def test_gather_tensor_with_other_arguments_on_one_rank_says_what_every_rank_must_pass():
    # It spoke of a program that rank 1 built and of run(), neither of which the caller wrote.
    mesh = DeviceMesh.of_shape([2])

    def rank_fn(comm):
        dtype = np.float32 if comm.rank == 0 else np.float64
        with pytest.raises(ValueError, match="gather_tensor: every rank must call it, with the "
                                             "same shape, dtype, mesh and placements"):
            meshfuse.gather_tensor(np.ones((3, 4), dtype), [6, 4], mesh, Shard(0), comm)

    on_ranks(2, rank_fn)

    def wrong_part_on_rank_1(comm):
        # Rank 1 refuses its part before communicating; rank 0 fails in the comparison of
        # programs, which it hears of with the same hint.
        rows = 3 if comm.rank == 0 else 2
        with pytest.raises(meshfuse.Error) as info:
            meshfuse.gather_tensor(np.ones((rows, 4), np.float32), [6, 4], mesh, Shard(0), comm)
        if comm.rank == 0:
            assert "gather_tensor: every rank must call it, with the same shape" in str(info.value)
        else:
            assert "'local' on rank 1 must be [3, 4]" in str(info.value)

    on_ranks(2, wrong_part_on_rank_1)


def test_a_partial_output_is_made_locally_and_its_terms_sum_to_the_whole():
    # DTensor's partition of a value: a shard of a sum padded with zeros, no communication.
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    p = meshfuse.Program()
    v = p.define_tensor("x", [5, 2], "f32")
    p.set_mesh(DeviceMesh.of_shape([4]))
    p.set_placements(v, Shard(0))
    p.add_output(v, Partial())

    def rank_fn(comm):
        executor = meshfuse.MultiDeviceExecutor(p, comm)
        (term,) = executor.run([meshfuse.shard_tensor(x, p.mesh, Shard(0), comm.rank)])
        return term, str(executor.plan()), meshfuse.shard_tensor(x, p.mesh, Partial(), comm.rank)

    results = on_ranks(4, rank_fn)
    np.testing.assert_array_equal(sum(term for term, _, _ in results.values()), x)
    for rank, (term, plan, placed) in results.items():
        assert "partition(sum, dim 0 at" in plan and "all_" not in plan, plan
        rows = slice([0, 2, 3, 4][rank], [2, 3, 4, 5][rank])  # numpy.array_split's parts
        expected = np.zeros_like(x)
        expected[rows] = x[rows]
        np.testing.assert_array_equal(term, expected)
        np.testing.assert_array_equal(placed, x if rank == 0 else np.zeros_like(x))
