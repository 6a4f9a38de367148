"""pack_sequence, unpack_sequence and continuous_count against torch (masking, index assignment,
bincount), through the raw bindings and the autograd adapter (skipped without torch)."""

import pytest

torch = pytest.importorskip("torch")

import meshfuse  # noqa: E402
import meshfuse.torch as mt  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and meshfuse.cuda_device_count() else [])


def _mask(lengths, seq_len, padding_side):
    pos = torch.arange(seq_len)[None, :]
    lengths = lengths[:, None]
    return pos < lengths if padding_side == "right" else pos >= seq_len - lengths


def _offsets(lengths, dtype):
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_pack_and_unpack_match_torch_masking(device, padding_side, dtype):
    lengths = torch.tensor([3, 0, 5, 1, 5])  # an empty and two full (= S) sequences
    b, s = len(lengths), 5
    x = torch.randint(0, 100, (b, s, 3, 2)).to(dtype).to(device)
    mask = _mask(lengths, s, padding_side).to(device)
    for index_dtype in (torch.int32, torch.uint32, torch.int64):
        cu = _offsets(lengths, index_dtype).to(device)
        packed = torch.empty((int(lengths.sum()), 3, 2), dtype=dtype, device=device)
        meshfuse.pack_sequence(x, cu, packed, padding_side=padding_side)
        assert torch.equal(packed, x[mask])
        padded = torch.full_like(x, 7)
        meshfuse.unpack_sequence(packed, cu, padded, padding_side=padding_side)
        expected = torch.zeros_like(x)
        expected[mask] = packed
        assert torch.equal(padded, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_sequence_autograd_is_unpack_and_back(device):
    lengths = torch.tensor([2, 4, 0, 3])
    cu = _offsets(lengths, torch.int32).to(device)
    mask = _mask(lengths, 4, "left").to(device)
    x = torch.randn(4, 4, 8, dtype=torch.float64, device=device, requires_grad=True)
    packed = mt.pack_sequence(x, cu)
    torch.testing.assert_close(packed, x[mask], rtol=0, atol=0)
    grad = torch.randn_like(packed)
    (ours,) = torch.autograd.grad(packed, x, grad)
    (theirs,) = torch.autograd.grad(x[mask], x, grad)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)

    y = packed.detach().requires_grad_()
    padded = mt.unpack_sequence(y, cu, 4, 4)
    torch.testing.assert_close(padded, x.detach() * mask[..., None], rtol=0, atol=0)
    grad_padded = torch.randn_like(padded)
    (ours,) = torch.autograd.grad(padded, y, grad_padded)
    torch.testing.assert_close(ours, grad_padded[mask], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_uint32_tensors_pass_both_ways_and_serve_as_cu_seqlens(device):
    # torch.uint32 through DLPack as data (values past 2^31 keep their bits) and as cu_seqlens,
    # through the adapter and the raw binding. torch has few uint32 kernels: compare as int64.
    x = torch.tensor([[2**31, 2, 3], [2**32 - 1, 5, 6]]).to(torch.uint32)[..., None].to(device)
    cu = torch.tensor([0, 2, 3]).to(torch.uint32).to(device)
    packed = mt.pack_sequence(x, cu, padding_side="right")
    assert packed.dtype == torch.uint32
    assert packed.to(torch.int64).flatten().tolist() == [2**31, 2, 2**32 - 1]
    padded = torch.empty_like(x)
    meshfuse.unpack_sequence(packed, cu, padded, padding_side="right")
    assert padded.to(torch.int64).squeeze(-1).tolist() == [[2**31, 2, 0], [2**32 - 1, 0, 0]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_continuous_count_matches_bincount_and_ignores_values_out_of_range(device, dtype):
    x = torch.randint(-2, 70, (100_003,), dtype=dtype, device=device)
    kept = x[(x >= 0) & (x < 64)]
    expected = torch.bincount(kept, minlength=64)
    torch.testing.assert_close(mt.continuous_count(x, 64), expected, rtol=0, atol=0)
    out = torch.full((64,), 7, dtype=torch.int64, device=device)
    meshfuse.continuous_count(x[::2], out)  # a strided view
    torch.testing.assert_close(out, torch.bincount(x[::2][(x[::2] >= 0) & (x[::2] < 64)],
                                                   minlength=64), rtol=0, atol=0)


def test_bad_cu_seqlens_and_padding_side_raise_meshfuse_errors():
    x = torch.zeros(3, 4, 2)
    out = torch.zeros(5, 2)
    with pytest.raises(meshfuse.Error, match=r"pack_sequence: cu_seqlens\[0\] must be 0, got 1"):
        meshfuse.pack_sequence(x, torch.tensor([1, 2, 3, 5]), out)
    with pytest.raises(meshfuse.Error, match=r"non-decreasing.*cu_seqlens\[2\] = 2"):
        meshfuse.pack_sequence(x, torch.tensor([0, 3, 2, 5]), out)
    with pytest.raises(meshfuse.Error, match=r"must equal T = 5.*got 4"):
        meshfuse.pack_sequence(x, torch.tensor([0, 1, 2, 4]), out)
    with pytest.raises(meshfuse.Error, match=r"padding_side must be 'left' or 'right', got 'up'"):
        meshfuse.pack_sequence(x, torch.tensor([0, 1, 2, 5]), out, padding_side="up")
    with pytest.raises(meshfuse.Error, match=r"continuous_count: output 'out' must be i64"):
        meshfuse.continuous_count(torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))


def test_the_torch_ops_check_cu_seqlens_before_taking_shapes_from_it():
    # torch's own errors came first: "only one element tensors can be converted to Python
    # scalars", an IndexError, "negative dimension -1".
    x = torch.zeros(3, 4, 2)
    with pytest.raises(meshfuse.ShapeMismatchError, match=r"pack_sequence: cu_seqlens must be 1-D"):
        mt.pack_sequence(x, torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(meshfuse.ShapeMismatchError, match=r"pack_sequence: cu_seqlens .* shape \[0\]"):
        mt.pack_sequence(x, torch.tensor([], dtype=torch.int64))
    with pytest.raises(meshfuse.InvalidArgumentError, match="unpack_sequence: batch_size and "
                       "sequence_length must be >= 0, got 3 and -1"):
        mt.unpack_sequence(torch.zeros(5, 2), torch.tensor([0, 1, 2, 5]), 3, -1)
    weight = torch.zeros(1, 2, 2)
    with pytest.raises(meshfuse.ShapeMismatchError, match="rnn: cu_seqlens must be 1-D"):
        mt.rnn(torch.zeros(5, 1, 2), weight, cu_seqlens=torch.tensor([], dtype=torch.int32))
    with pytest.raises(meshfuse.ShapeMismatchError, match="rnn: input has too few dims"):
        mt.rnn(torch.zeros(5), weight)
