"""Communicators from Python: the local backend (ranks as threads) and gloo (two processes)."""

import gc
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import meshfuse


def value(rank, n):
    return (rank + 1) * (np.arange(n) % 5 + 1)


def test_local_ranks_reduce_gather_and_report_the_backend():
    results = {}

    def rank_fn(comm):
        r, n = comm.rank, comm.size
        x = value(r, 10).astype(np.float32)
        work = comm.all_reduce(x, op="max")
        work.wait()
        assert work.record.backend == "local"
        assert work.record.op == "all_reduce" and work.record.reduction == "max"
        assert "all_reduce(max) f32 x 10" in str(work.record) and "on local" in str(work.record)
        # Uneven shards: rank r contributes r + 1 rows of 2.
        rows = [1, 2, 3]
        mine = np.full((rows[r], 2), r, np.int64)
        gathered = np.empty((sum(rows), 2), np.int64)
        comm.all_gather(mine, gathered, output_split_sizes=rows).wait()
        results[r] = (x, gathered, n)

    meshfuse.run_local(3, rank_fn)
    expected_max = value(2, 10).astype(np.float32)
    expected_gather = np.repeat([0, 1, 1, 2, 2, 2], 2).reshape(6, 2)
    for r in range(3):
        x, gathered, n = results[r]
        assert n == 3
        np.testing.assert_array_equal(x, expected_max)
        np.testing.assert_array_equal(gathered, expected_gather)


def test_local_send_recv_passes_uneven_parts_around_a_ring():
    results = {}

    def rank_fn(comm):
        r, n = comm.rank, comm.size
        nxt, prev = (r + 1) % n, (r + n - 1) % n
        got = np.full(2 * prev, -1, np.float32)
        work = comm.send_recv(value(r, 2 * r).astype(np.float32), nxt, got, prev)
        work.wait()
        assert work.record.op == "send_recv" and work.record.root == nxt and work.record.source == prev
        assert str(work.record).endswith(f"to {nxt}, from {prev}, #{work.record.seq}")
        results[r] = got

    meshfuse.run_local(3, rank_fn)
    for r in range(3):
        prev = (r + 2) % 3
        np.testing.assert_array_equal(results[r], value(prev, 2 * prev).astype(np.float32))


def test_local_bf16_avg_and_reduce_scatter():
    torch = pytest.importorskip("torch")
    results = {}

    def rank_fn(comm):
        x = torch.tensor(value(comm.rank, 8), dtype=torch.bfloat16)
        comm.all_reduce(x, op="avg").wait()
        full = torch.arange(8, dtype=torch.float32) * (comm.rank + 1)
        out = torch.empty(4, dtype=torch.float32)
        comm.reduce_scatter(full, out).wait()
        results[comm.rank] = (x.float(), out)

    meshfuse.run_local(2, rank_fn)
    avg = torch.tensor((value(0, 8) + value(1, 8)) / 2, dtype=torch.float32)
    for r in range(2):
        x, out = results[r]
        assert torch.equal(x, avg)
        assert torch.equal(out, torch.arange(4 * r, 4 * r + 4, dtype=torch.float32) * 3)


def test_mismatched_counts_raise_naming_the_ranks():
    def rank_fn(comm):
        comm.all_reduce(np.zeros(4 if comm.rank == 0 else 8, np.float32)).wait()

    with pytest.raises(meshfuse.Error, match=r"ranks disagree.*rank 0 has all_reduce\(sum\) f32 x 4 "
                       r"but rank 1 has all_reduce\(sum\) f32 x 8"):
        meshfuse.run_local(2, rank_fn)
    # new_group lists as the ranks gave them, without the padding of the exchanged record.
    with pytest.raises(ValueError, match=r"new_group \[0\] but rank 1 has new_group \[1\]"):
        meshfuse.run_local(2, lambda comm: comm.new_group([comm.rank]))


def _expect_out_of_step_after_a_refusal_on_rank_1(refuse):
    # refuse(comm, x) on rank 1 raises before the call reaches the communicator; then both ranks
    # all_reduce, which must fail on both as out of step rather than pair with rank 1's refusal.
    errors = {}

    def rank_fn(comm):
        x = np.ones(4, np.float32)
        if comm.rank == 1:
            refuse(comm, x)
        try:
            comm.all_reduce(np.full(4, 1000.0, np.float32)).wait()
        except meshfuse.CommunicationError as e:
            errors[comm.rank] = str(e)

    meshfuse.run_local(2, rank_fn, timeout=60)
    assert sorted(errors) == [0, 1]
    assert all("ranks out of step" in e for e in errors.values())


def test_a_collective_refused_by_the_binding_leaves_the_ranks_out_of_step():
    # Rank 1's first all_reduce is refused before it reaches the communicator (a read-only
    # output): uncounted, rank 0's first call paired with rank 1's second and summed into the
    # wrong array, silently.
    def refuse(comm, x):
        x.flags.writeable = False
        with pytest.raises(ValueError, match="all_reduce: output 'tensor' is a read-only"):
            comm.all_reduce(x)

    _expect_out_of_step_after_a_refusal_on_rank_1(refuse)


@pytest.mark.parametrize("call, message", [
    (lambda comm, x: comm.all_reduce(x, op=5), "all_reduce: 'op' must be a str"),
    (lambda comm, x: comm.broadcast(x, root="0"), "broadcast: 'root' must be an int"),
    (lambda comm, x: comm.all_gather(x, np.empty(8, np.float32), output_split_sizes=[1.5, 2]),
     "all_gather: 'output_split_sizes' must be a list of ints"),
    (lambda comm, x: comm.reduce(x, 0, stream="default"), "reduce: 'stream' must be an int"),
])
def test_a_scalar_argument_of_the_wrong_type_on_one_rank_leaves_the_ranks_out_of_step(call,
                                                                                      message):
    # Refused by nanobind's own conversion before the binding ran, such a call was not counted:
    # rank 0's next collective then paired with rank 1's and summed 1 + 1000 silently.
    def refuse(comm, x):
        with pytest.raises(TypeError, match=message):
            call(comm, x)

    _expect_out_of_step_after_a_refusal_on_rank_1(refuse)


def test_an_unknown_reduce_op_is_named_by_the_collective_and_its_argument():
    def rank_fn(comm):
        with pytest.raises(ValueError,
                           match=r"all_reduce: 'op': reduce op: unknown name 'average'"):
            comm.all_reduce(np.ones(4, np.float32), op="average")
        return True

    assert meshfuse.run_local(1, rank_fn) == [True]
    with pytest.raises(ValueError, match=r"Partial: 'op': reduce op: unknown name 'summ'"):
        meshfuse.Partial("summ")


def test_collective_arrays_live_until_the_operation_completes():
    # A Work dropped at once (fire and forget) and a gather whose input goes out of scope: the
    # backend still reads the arrays after their handles are gone, when the late rank arrives.
    got = {}

    def rank_fn(comm):
        if comm.rank == 0:
            comm.all_reduce(np.full(1 << 18, 1.0, np.float32))
            work = comm.gather(input=np.full(1 << 18, 7.0, np.float32), output=None, root=1)
            gc.collect()
            np.full(1 << 20, -1.0, np.float32)  # would reuse freed memory
            work.wait()
        else:
            time.sleep(0.3)
            x = np.full(1 << 18, 2.0, np.float32)
            comm.all_reduce(x).wait()
            out = np.empty(2 << 18, np.float32)
            comm.gather(input=np.zeros(1 << 18, np.float32), output=out, root=1).wait()
            got["sum"], got["gathered"] = x, out

    meshfuse.run_local(2, rank_fn)
    np.testing.assert_array_equal(got["sum"], 3.0)
    np.testing.assert_array_equal(got["gathered"][: 1 << 18], 7.0)


def test_collective_arguments_that_are_not_arrays_are_named():
    def rank_fn(comm):
        with pytest.raises(TypeError, match="send: 'tensor' must be an array .* got list"):
            comm.send([1.0, 2.0], 1 - comm.rank)
        readonly = np.arange(2, dtype=np.float32)
        readonly.flags.writeable = False
        out = np.empty(4, np.float32)
        comm.all_gather(readonly, out).wait()  # an input may be read-only
        np.testing.assert_array_equal(out, [0, 1, 0, 1])

    meshfuse.run_local(2, rank_fn)


def test_mesh_teams_are_the_mesh_lines_split_once_and_kept():
    def rank_fn(comm):
        mesh = meshfuse.DeviceMesh([3, 1, 2, 0], [2, 2])
        rows, columns = comm.mesh_teams(mesh)
        assert columns.team == mesh.team(1, comm.rank) and rows.team == mesh.team(0, comm.rank)
        x = np.array([comm.rank], np.int64)
        columns.all_reduce(x).wait()
        assert x[0] == sum(mesh.team(1, comm.rank))
        again = comm.mesh_teams(mesh)
        assert again[0] is rows and again[1] is columns  # kept, not split again
        with pytest.raises(ValueError, match="mesh_teams"):
            comm.mesh_teams(meshfuse.DeviceMesh([0, 1], [2]))

    meshfuse.run_local(4, rank_fn)


def test_local_world_gives_each_thread_its_communicator_once():
    world = meshfuse.LocalWorld(2)
    assert world.size == 2
    world.communicator(0)
    with pytest.raises(meshfuse.InvalidArgumentError,
                       match="rank 0's communicator was already taken"):
        world.communicator(0)


GLOO_RANK = textwrap.dedent("""
    import numpy as np
    import meshfuse
    comm = meshfuse.init_communicator(backend="cpu:gloo", timeout=20)
    x = np.full(5, comm.rank + 1, np.float32)
    work = comm.all_reduce(x)
    work.wait()
    out = np.empty(2 * 5, np.float32)
    comm.all_gather(x, out).wait()
    try:  # a second rendezvous beside the first: refused at once (it hung or blamed the bind)
        meshfuse.init_communicator(backend="cpu:gloo", timeout=20)
        second = "joined twice"
    except ValueError as e:
        second = "refused" if "has already joined its job" in str(e) else str(e)
    print(comm.rank, comm.size, work.record.backend, x.tolist(), out.tolist(), second, flush=True)
""")


def test_gloo_all_reduce_across_two_processes():
    if "gloo" not in meshfuse.communicator_backends():
        pytest.skip("this build has no gloo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = os.urandom(16).hex()  # the job's store secret, as meshfuse launch makes one
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   MESHFUSE_STORE_SECRET=secret)
        procs.append(subprocess.Popen([sys.executable, "-c", GLOO_RANK], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, err
        assert out.strip() == f"{rank} 2 gloo [3.0, 3.0, 3.0, 3.0, 3.0] [3.0, 3.0, 3.0, 3.0, 3.0, " \
                              "3.0, 3.0, 3.0, 3.0, 3.0] refused"


def test_meshfuse_imported_before_torch_leaves_torch_usable():
    # meshfuse loads no CUDA or NCCL library that torch would bind to (it opens cuBLASLt and NCCL
    # at first use), and it makes libstdc++ global so that torch imported after it binds its C++
    # runtime symbols there (meshfuse/__init__.py): torch loads and runs its own libraries.
    pytest.importorskip("torch")
    code = "import meshfuse, torch; print(torch.tensor([1.0]) + 1)"
    result = subprocess.run([sys.executable, "-u", "-c", code], capture_output=True, text=True,
                            env=dict(os.environ), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tensor([2.])" in result.stdout
