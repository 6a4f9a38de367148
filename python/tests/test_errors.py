"""Errors as Python code expects them: meshfuse.Error subclasses by code, each also the built-in
exception of its kind; outputs that cannot be written named; a rank's exception kept whole."""

import _thread
import threading
import time

import numpy as np
import pytest

import meshfuse


def test_each_code_is_a_subclass_of_error_and_of_its_builtin():
    expected = {
        meshfuse.InvalidArgumentError: ValueError,
        meshfuse.ShapeMismatchError: ValueError,
        meshfuse.DTypeMismatchError: TypeError,
        meshfuse.DeviceMismatchError: RuntimeError,
        meshfuse.UnsupportedError: NotImplementedError,
        meshfuse.BackendUnavailableError: RuntimeError,
        meshfuse.CommunicationError: RuntimeError,
        meshfuse.CommunicationTimeoutError: TimeoutError,
        meshfuse.OutOfMemoryError: RuntimeError,
        meshfuse.InternalError: RuntimeError,
    }
    for cls, builtin in expected.items():
        assert issubclass(cls, meshfuse.Error) and issubclass(cls, builtin), cls
    assert meshfuse.ShapeMismatchError.code == "shape mismatch"
    assert not issubclass(meshfuse.ShapeMismatchError, RuntimeError)
    # docs/PYTHON.md's upgrading note: Error itself is no RuntimeError any more.
    assert not issubclass(meshfuse.Error, RuntimeError)
    assert not issubclass(meshfuse.DTypeMismatchError, RuntimeError)
    assert not issubclass(meshfuse.CommunicationTimeoutError, RuntimeError)


def test_shape_dtype_and_argument_errors_raise_value_and_type_errors_with_the_message():
    x, w = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    y, rstd = np.empty_like(x), np.empty(4, np.float32)
    with pytest.raises(ValueError, match=r"^\[shape mismatch\] rmsnorm: .*'weight'") as e:
        meshfuse.rmsnorm(x, np.ones(7, np.float32), y, rstd, 1e-5)
    assert type(e.value) is meshfuse.ShapeMismatchError
    with pytest.raises(TypeError, match=r"\[dtype mismatch\] rmsnorm: output 'rstd'"):
        meshfuse.rmsnorm(x, w, y, np.empty(4, np.float64), 1e-5)
    with pytest.raises(meshfuse.InvalidArgumentError, match="eps"):
        meshfuse.rmsnorm(x, w, y, rstd, -1.0)


def test_a_backend_that_cannot_run_raises_a_runtime_error():
    x = np.ones((4, 8), np.float32)
    with meshfuse.force_kernel_backend("cuda"):
        with pytest.raises(meshfuse.UnsupportedError,
                           match=r"swiglu: kernel backend 'cuda' \(forced\) cannot run") as e:
            meshfuse.swiglu(x, x, np.empty_like(x))
    assert isinstance(e.value, RuntimeError)  # UnsupportedError is a RuntimeError subclass


def test_a_read_only_or_wrong_kind_output_names_the_argument():
    x, w = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    y = np.empty_like(x)
    y.flags.writeable = False
    with pytest.raises(ValueError, match=r"output 'y' is a read-only"):
        meshfuse.rmsnorm(x, w, y, None, 1e-5)
    with pytest.raises(TypeError, match=r"output 'rstd' must be a writable array.*list"):
        meshfuse.rmsnorm(x, w, np.empty_like(x), [0.0] * 4, 1e-5)


def test_run_local_returns_each_ranks_result():
    assert meshfuse.run_local(3, lambda comm: comm.rank * 10) == [0, 10, 20]


def test_an_exception_in_a_rank_keeps_its_type_and_says_the_rank():
    def rank_fn(comm):
        if comm.rank == 1:
            raise KeyError("missing")
        return comm.rank

    with pytest.raises(KeyError, match="missing") as e:
        meshfuse.run_local(2, rank_fn)
    if hasattr(e.value, "add_note"):  # Python 3.11
        assert e.value.__notes__ == ["raised by rank 1 of run_local"]

    def bad_shape(comm):
        x = np.ones((2, 4), np.float32)
        meshfuse.swiglu(x, np.ones((2, 5), np.float32), np.empty_like(x))

    with pytest.raises(meshfuse.ShapeMismatchError, match=r"swiglu"):
        meshfuse.run_local(2, bad_shape)


def test_a_rank_that_raises_stops_the_others_waiting_for_it():
    # Rank 0 waits in an all_reduce for rank 1, which raises instead: run_local used to wait out
    # the whole timeout and then raise rank 0's timeout, without rank 1's error.
    seen = []

    def rank_fn(comm):
        if comm.rank == 1:
            raise KeyError("the real cause")
        try:
            comm.all_reduce(np.ones(4, np.float32)).wait()
        except meshfuse.Error as e:
            seen.append(e)
            raise

    start = time.monotonic()
    with pytest.raises(KeyError, match="the real cause"):
        meshfuse.run_local(2, rank_fn, timeout=120)
    assert time.monotonic() - start < 30
    assert isinstance(seen[0], meshfuse.CommunicationError)
    assert "rank 1 of run_local raised" in str(seen[0]) and "the real cause" in str(seen[0])


def test_ctrl_c_during_run_local_stops_the_waiting_ranks_at_once():
    # Both ranks wait for messages that never come; Ctrl-C (interrupt_main, as SIGINT does) used
    # to arrive only after the 120 s timeout.
    seen = []

    def rank_fn(comm):
        if comm.rank == 0:  # from inside run_local: a timer started before could fire before it
            threading.Timer(0.3, _thread.interrupt_main).start()
        try:
            comm.recv(np.empty(4, np.float32), src=1 - comm.rank).wait()
        except meshfuse.Error as e:
            seen.append(e)
            raise

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        meshfuse.run_local(2, rank_fn, timeout=120)
    assert time.monotonic() - start < 30
    assert len(seen) == 2
    assert all(isinstance(e, meshfuse.CommunicationError) for e in seen)
    assert "run_local was interrupted" in str(seen[0])


def test_a_collective_that_waits_too_long_raises_timeout_error():
    timed_out = threading.Event()

    def rank_fn(comm):
        if comm.rank == 0:  # rank 1 never joins, but stays (a rank that returned fails it at once)
            try:
                comm.all_reduce(np.ones(4, np.float32)).wait()
            finally:
                timed_out.set()
        else:
            timed_out.wait(60)

    with pytest.raises(TimeoutError) as e:
        meshfuse.run_local(2, rank_fn, timeout=0.5)
    assert isinstance(e.value, meshfuse.CommunicationTimeoutError)


def test_a_rank_that_returned_fails_the_collectives_that_need_it_at_once():
    # They waited out the timeout (300 s by default) for a rank whose function had returned.
    def rank_fn(comm):
        if comm.rank == 0:
            comm.all_reduce(np.ones(4, np.float32)).wait()

    start = time.monotonic()
    with pytest.raises(meshfuse.CommunicationError, match="rank 1 has returned from its "
                                                          "run_local function"):
        meshfuse.run_local(2, rank_fn, timeout=120)
    assert time.monotonic() - start < 30


def test_jax_arrays_are_inputs_but_never_outputs():
    # JAX arrays are immutable (their DLPack export carries no read-only flag): an output that is
    # one is refused as read-only rather than written.
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    cpu = jax.devices("cpu")[0]  # beside the NumPy output, also where JAX's default is a GPU

    def on_cpu(a):
        return jax.device_put(a, cpu)

    x = on_cpu(jnp.asarray(np.random.default_rng(1).standard_normal((4, 8), np.float32)))
    w = on_cpu(jnp.ones(8, jnp.float32))
    y = np.empty((4, 8), np.float32)
    meshfuse.rmsnorm(x, w, y, None, 1e-5)
    expected = np.asarray(x) / np.sqrt((np.asarray(x) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, expected, rtol=1e-5)
    with pytest.raises(meshfuse.InvalidArgumentError, match="output 'y' is a read-only"):
        meshfuse.rmsnorm(x, w, on_cpu(jnp.zeros((4, 8), jnp.float32)), None, 1e-5)


def test_a_collective_names_a_read_only_array_it_would_write():
    def rank_fn(comm):
        x = np.ones(4, np.float32)
        x.flags.writeable = False
        comm.all_reduce(x).wait()

    with pytest.raises(meshfuse.InvalidArgumentError, match="output 'tensor' is a read-only"):
        meshfuse.run_local(1, rank_fn)


def test_send_recv_names_a_read_only_receive_buffer():
    def rank_fn(comm):
        recv = np.zeros(4, np.float32)
        recv.flags.writeable = False
        comm.send_recv(np.ones(4, np.float32), 0, recv, 0).wait()

    with pytest.raises(meshfuse.InvalidArgumentError,
                       match="output 'recv_tensor' is a read-only"):
        meshfuse.run_local(1, rank_fn)


def test_an_array_of_a_dtype_meshfuse_lacks_names_the_argument_and_its_dtype():
    x = np.ones((2, 4), np.int16)
    with pytest.raises(meshfuse.DTypeMismatchError,
                       match="'x' is an array of dtype int16, which no meshfuse op takes"):
        meshfuse.softmax(x, np.empty((2, 4), np.float32))
    with pytest.raises(meshfuse.DTypeMismatchError, match="'labels' is an array of dtype int16"):
        meshfuse.cross_entropy(np.zeros((2, 4), np.float32), np.zeros(2, np.int16),
                               np.empty((), np.float32), None)
    with pytest.raises(meshfuse.DTypeMismatchError, match="'y' is an array of dtype complex64"):
        meshfuse.softmax(np.zeros((2, 4), np.float32), np.empty((2, 4), np.complex64))


def test_a_zero_timeout_is_a_value_error():
    # 0 would fail every operation that waits at all; it once reached the rendezvous as "cannot
    # reach the store within 0 ms".
    with pytest.raises(meshfuse.InvalidArgumentError, match="timeout: expected seconds > 0.*got 0"):
        meshfuse.run_local(1, lambda comm: None, timeout=0)
    # Past a year, now + timeout overflowed the clock: every wait failed at once.
    with pytest.raises(meshfuse.InvalidArgumentError, match="at most a year.*got 10000000000"):
        meshfuse.run_local(1, lambda comm: None, timeout=1e10)


def test_a_cuda_stream_with_cpu_arrays_is_a_value_error_naming_the_op():
    # It was ignored silently: the caller's ordering on that stream did not hold.
    x = np.ones((2, 4), np.float32)
    with pytest.raises(meshfuse.InvalidArgumentError,
                       match="rmsnorm: stream: a native stream handle .* on the CPU"):
        meshfuse.rmsnorm(x, None, np.empty_like(x), None, 1e-5, stream=12345)

    def rank_fn(comm):
        with pytest.raises(meshfuse.InvalidArgumentError, match="all_reduce: stream: a native"):
            comm.all_reduce(np.ones(4, np.float32), stream=12345)
        comm.barrier().wait()  # refused before any exchange, on every rank: still in step

    meshfuse.run_local(2, rank_fn)
