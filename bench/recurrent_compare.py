#!/usr/bin/env python3
"""meshfuse rnn / gru against a per-step PyTorch loop (eager, and on CUDA its torch.compile).

At B sequences of S steps, N heads of H (default B=16, S=4096, N=64, H=64 and 128, bf16), forward
and backward: the median / p20 / p80 time of each implementation, called interleaved
(A B C A B C ...) on the same inputs after warm-up calls; meshfuse's speed-up over each (ratio of
medians); the time per step; and the bytes a step must move at least (read the step's input rows,
write its output rows: (pairs + 1)·B·N·H·e forward, with the weights read once per call; the
backward reads grad_output, output and the GRU's inputs and writes the input gradients) with the
bandwidth that implies, against the device's copy bandwidth measured in the same run.
Backward: meshfuse's backward kernel against torch.autograd.grad over a graph built once.

    python3 bench/recurrent_compare.py --device cuda
    python3 bench/recurrent_compare.py --device cpu --seq-len 64

Needs the meshfuse package on PYTHONPATH (<build>/python) and torch (bench/requirements.txt).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

import meshfuse.torch as mt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_compare import DTYPES, Timer, copy_bandwidth, stats  # noqa: E402


def _mm(h, w):
    # Per head: (B, N, H) @ (N, H, H) as one batched GEMM over the heads. A broadcast matmul of
    # (B, N, 1, H) @ (N, H, H) would copy the weights to (B, N, H, H) every step, and
    # torch.compile keeps those copies for the backward (out of memory over 4096 steps).
    return torch.einsum("bnh,nhk->bnk", h, w)


def rnn_step(x, w, h):
    return torch.tanh(_mm(h, w[0]) + x[0])


def gru_step(x, w, h):
    f = torch.sigmoid(_mm(h, w[1]) + x[1])
    r = torch.sigmoid(_mm(h, w[2]) + x[2])
    z = torch.tanh(_mm(h * r, w[0]) + x[0])
    return f * h + (1 - f) * z


def torch_loop(step, inputs, weights, h0):
    """The seed library's reference: one step at a time over (B, S, N, H) inputs."""
    h, outputs = h0, []
    for s in range(inputs[0].shape[1]):
        h = step([x[:, s] for x in inputs], weights, h)
        outputs.append(h)
    return torch.stack(outputs, 1), h


def meshfuse_forward(gru, inputs, weights, h0):
    if gru:
        (x, xf, xr), (w, wf, wr) = inputs, weights
        return mt.gru_forward(x, w, xf, wf, xr, wr, h0)
    return mt.rnn_forward(inputs[0], weights[0], h0)


def meshfuse_backward(gru, dy, dhn, y, inputs, weights, h0):
    if gru:
        (x, xf, xr), (w, wf, wr) = inputs, weights
        return mt.gru_backward(dy, dhn, y, x, w, xf, wf, xr, wr, h0)
    return mt.rnn_backward(dy, dhn, y, inputs[0].shape, weights[0], h0)


def measure(impls, timer, calls, warmup):
    """Interleaves the implementations after `warmup` calls each; {name: [ms per call]}."""
    for fn in impls.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in impls}
    for _ in range(calls):
        for name, fn in impls.items():
            times[name].append(timer(fn))
    return times


def cases(op, b, s, n, h, dtype, device, compile_step):
    """(direction, bytes per call, {impl: fn}, check) for one op at one size."""
    gru = op == "gru"
    pairs = 3 if gru else 1
    e = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    inputs = [randn(b, s, n, h) for _ in range(pairs)]
    weights = [randn(n, h, h, std=h ** -0.5) for _ in range(pairs)]
    h0 = randn(b, n, h, std=0.5)
    dy, dhn = randn(b, s, n, h), randn(b, n, h)
    step = gru_step if gru else rnn_step
    steps = {"eager": step}
    if compile_step:
        steps["compile"] = torch.compile(step, dynamic=False)

    tokens, states = b * s * n * h * e, b * n * h * e
    forward_bytes = (pairs + 1) * tokens + pairs * n * h * h * e + 2 * states
    impls = {"meshfuse": lambda: meshfuse_forward(gru, inputs, weights, h0)}
    for name, fn in steps.items():
        impls[name] = lambda fn=fn: torch_loop(fn, inputs, weights, h0)

    def forward_check():
        ours = meshfuse_forward(gru, inputs, weights, h0)[0].float()
        theirs = torch_loop(step, [x.float() for x in inputs], [w.float() for w in weights],
                            h0.float())[0]
        return (ours - theirs).abs().max().item()

    yield "forward", forward_bytes, impls, forward_check

    y = meshfuse_forward(gru, inputs, weights, h0)[0]
    backward_bytes = (8 if gru else 3) * tokens + 2 * pairs * n * h * h * e + 3 * states
    impls = {"meshfuse": lambda: meshfuse_backward(gru, dy, dhn, y, inputs, weights, h0)}
    leaves = [t.detach().requires_grad_() for t in (*inputs, *weights, h0)]
    for name, fn in steps.items():
        out, fin = torch_loop(fn, leaves[:pairs], leaves[pairs:2 * pairs], leaves[-1])
        impls[name] = lambda out=out, fin=fin: torch.autograd.grad(
            (out, fin), leaves, (dy, dhn), retain_graph=True)

    def backward_check():
        ours = meshfuse_backward(gru, dy, dhn, y, inputs, weights, h0)
        if gru:  # (input, weight, forget_input, ...) to the leaves' order: inputs, then weights
            ours = (*ours[0:6:2], *ours[1:6:2], ours[6])
        wide = [t.detach().float().requires_grad_() for t in (*inputs, *weights, h0)]
        out, fin = torch_loop(step, wide[:pairs], wide[pairs:2 * pairs], wide[-1])
        theirs = torch.autograd.grad((out, fin), wide, (dy.float(), dhn.float()))
        scale = max(t.abs().max().item() for t in theirs)
        return max((a.float() - t).abs().max().item() for a, t in zip(ours, theirs)) / scale

    yield "backward", backward_bytes, impls, backward_check


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dims", default="64,128", help="comma-separated H values")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--ops", default="rnn,gru")
    p.add_argument("--no-compile", action="store_true",
                   help="skip torch.compile of the step (timed on cuda only)")
    p.add_argument("--calls", type=int, default=5, help="timed calls per implementation")
    p.add_argument("--warmup", type=int, default=2, help="warm-up calls per implementation")
    p.add_argument("--check", action="store_true",
                   help="also print meshfuse's max error against an f32 torch loop")
    p.add_argument("--json", default="", help="write the records here")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    timer = Timer(device)
    compile_step = a.device == "cuda" and not a.no_compile
    b, s, n = a.batch, a.seq_len, a.heads

    peak = copy_bandwidth(device, timer)
    print(f"# rnn/gru, {a.dtype} on {device} (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads), B={b} S={s} N={n}; measured copy bandwidth "
          f"{peak:.1f} GB/s; median of {a.calls} interleaved calls after {a.warmup} warm-up",
          flush=True)
    print(f"{'op':4} {'H':>4} {'dir':8} {'impl':9} {'median ms':>10} {'p20':>9} {'p80':>9} "
          f"{'us/step':>9} {'KiB/step':>9} {'GB/s':>8} {'of copy':>8} {'meshfuse x':>10}")
    records = []
    for op in filter(None, a.ops.split(",")):
        for h in (int(v) for v in a.head_dims.split(",")):
            for direction, nbytes, impls, check in cases(op, b, s, n, h, dtype, device,
                                                         compile_step):
                t0 = time.perf_counter()
                times = measure(impls, timer, a.calls, a.warmup)
                base = statistics.median(times["meshfuse"])
                for name, ms in times.items():
                    med, p20, p80 = stats(ms)
                    gbps = nbytes / (med * 1e-3) / 1e9
                    print(f"{op:4} {h:4} {direction:8} {name:9} {med:10.3f} {p20:9.3f} "
                          f"{p80:9.3f} {med * 1e3 / s:9.2f} {nbytes / s / 1024:9.1f} "
                          f"{gbps:8.1f} {gbps / peak:8.1%} {med / base:10.2f}", flush=True)
                    records.append(dict(op=op, head_dim=h, direction=direction, impl=name,
                                        device=a.device, dtype=a.dtype, batch=b, seq_len=s,
                                        heads=n, median_ms=med, p20_ms=p20, p80_ms=p80,
                                        us_per_step=med * 1e3 / s, bytes_per_step=nbytes / s,
                                        gbps=gbps, fraction_of_copy=gbps / peak,
                                        meshfuse_speedup=med / base, copy_gbps=peak))
                if a.check:
                    print(f"#   {op} H={h} {direction}: meshfuse vs f32 torch loop, max "
                          f"{'abs' if direction == 'forward' else 'rel'} err {check():.3e}")
                print(f"#   ({time.perf_counter() - t0:.0f} s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
