#!/usr/bin/env python3
"""meshfuse against PyTorch eager (and torch.compile) in one process, interleaved.

For each op and direction at a model's shapes: median / p20 / p80 time of every implementation,
called in turn (A B C A B C ...) on the same inputs, GB/s by the byte formulas of
docs/BENCHMARKING.md, the fraction of the machine's copy bandwidth measured in the same run
(a torch copy of a buffer far larger than the last-level cache), and meshfuse's speed-up over each
baseline (ratio of medians). Backward directions time only the backward: meshfuse's backward
kernel against torch.autograd.grad over a graph built once. On a CPU, softmax also runs into
outputs allocated once ("meshfuse out" against "eager out", aten's out= kernels): a fresh output
of that size costs both sides the same page faults and zeroing, which can take longer than the
kernel itself (docs/kernels/softmax.md).

    python3 bench/torch_compare.py --device cpu --model llama-3.1-8b --tokens 4096
    python3 bench/torch_compare.py --device cuda --model llama-3.1-8b --tokens 16384 --compile
    python3 bench/torch_compare.py --device cpu --tokens 512 --ops linear   # linears on a CPU

Needs the meshfuse package on PYTHONPATH (<build>/python) and torch (bench/requirements.txt).
"""

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import meshfuse
import meshfuse.torch as mt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def load_model(name):
    path = name if os.path.exists(name) else os.path.join(ROOT, "configs", "models", name + ".json")
    with open(path) as f:
        return json.load(f)


class Timer:
    """Times one callable: CUDA events on the current stream (device time, as the CLI's
    StreamTimer), or the host clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Keeps the GPU busy (~100 us) while the host queues the start event and the first
            # calls: on an idle stream the host's time to launch the first call (15-35 us for
            # these wrappers) would be counted as device time. A training step's host runs ahead.
            torch.cuda._sleep(200_000)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def measure(impls, timer, min_calls, min_seconds):
    """Interleaves the implementations, in a shuffled order each round; returns
    {name: [ms per call, ...]}.

    On a GPU each sample times a burst of back-to-back calls lasting about 2 ms between two
    events, so that the host's per-call overhead (Python, DLPack, torch's dispatcher) overlaps
    the device work as in a real training step, and divides by the burst length."""
    bursts = {}
    for name, fn in impls.items():  # warm-up: 10 calls or 25 ms, whichever is longer
        t_end = time.perf_counter() + 0.025
        for i in range(10**9):
            fn()
            if i >= 9 and time.perf_counter() > t_end:
                break
        one = timer(fn)
        bursts[name] = max(1, min(200, int(2.0 / max(one, 1e-3)))) if timer.cuda else 1
    if timer.cuda:
        torch.cuda.synchronize()
    times = {name: [] for name in impls}
    names, order = list(impls), random.Random(0)
    t_end = time.perf_counter() + min_seconds
    while len(times[names[0]]) < min_calls or time.perf_counter() < t_end:
        # A new order each round (seeded), so that no implementation always runs right after the
        # same other one: the GPU's clocks and caches carry over from one sample to the next.
        order.shuffle(names)
        for name in names:
            fn, n = impls[name], bursts[name]
            times[name].append(timer(lambda: [fn() for _ in range(n)]) / n)
    return times


def stats(ms):
    q = statistics.quantiles(ms, n=5) if len(ms) >= 5 else [min(ms)] * 4
    return statistics.median(ms), q[0], q[3]


def copy_bandwidth(device, timer):
    """GB/s of a device (or host) copy, counting bytes read plus bytes written."""
    n = (2 << 30) // 4 if device.type == "cuda" else (1 << 30) // 4  # 2 GiB / 1 GiB of f32
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = measure({"copy": lambda: dst.copy_(src)}, timer, 10, 0.5)["copy"]
    return 2 * src.numel() * 4 / (statistics.median(ms) * 1e-3) / 1e9


def cases(cfg, tokens, dtype, device, vocab_tokens):
    """(op, direction, bytes, {impl: fn}) at the model's shapes; inputs random normal."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, grad=False):
        t = torch.randn(*shape, generator=g, device=device, dtype=dtype)
        return t.requires_grad_(grad)

    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    eps = cfg.get("rms_norm_eps", 1e-5)
    e = torch.finfo(dtype).bits // 8
    N, NV = tokens, vocab_tokens

    def grad_of(out_fn, inputs, dy):
        out = out_fn()
        return lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True)

    # rmsnorm
    x, w, dy = randn(N, H, grad=True), randn(H, grad=True), randn(N, H)
    ref = lambda x, w: F.rms_norm(x, (H,), w, eps)
    y, _, rstd = mt.rmsnorm_forward(x, w, eps)
    yield ("rmsnorm", "forward", 2 * N * H * e + H * e,
           {"meshfuse": lambda: mt.rmsnorm_forward(x, w, eps), "eager": lambda: ref(x, w)}, ref,
           (x, w))
    yield ("rmsnorm", "backward", 3 * N * H * e + 2 * H * e,
           {"meshfuse": lambda: mt.rmsnorm_backward(dy, x, w, rstd, False),
            "eager": grad_of(lambda: ref(x, w), (x, w), dy)}, None, None)

    # fused residual-add rmsnorm
    res = randn(N, H, grad=True)

    def fused_ref(x, res, w):
        r = x + res
        return F.rms_norm(r, (H,), w, eps), r

    _, r, rstd_f = mt.rmsnorm_forward(x, w, eps, residual=res)
    dr = randn(N, H)
    yield ("fused_residual_add_rmsnorm", "forward", 4 * N * H * e + H * e,
           {"meshfuse": lambda: mt.rmsnorm_forward(x, w, eps, residual=res),
            "eager": lambda: fused_ref(x, res, w)}, fused_ref, (x, res, w))
    yield ("fused_residual_add_rmsnorm", "backward", 4 * N * H * e + 2 * H * e,
           {"meshfuse": lambda: mt.rmsnorm_backward(dy, r, w, rstd_f, True, grad_r=dr),
            "eager": grad_of(lambda: fused_ref(x, res, w), (x, res, w), (dy, dr))}, None, None)

    # swiglu
    gate, up, dyi = randn(N, I, grad=True), randn(N, I, grad=True), randn(N, I)
    sw = lambda gate, up: F.silu(gate) * up
    yield ("swiglu", "forward", 3 * N * I * e,
           {"meshfuse": lambda: mt.swiglu_forward(gate, up), "eager": lambda: sw(gate, up)}, sw,
           (gate, up))
    yield ("swiglu", "backward", 5 * N * I * e,
           {"meshfuse": lambda: mt.swiglu_backward(dyi, gate, up),
            "eager": grad_of(lambda: sw(gate, up), (gate, up), dyi)}, None, None)

    # softmax over the vocabulary
    logits, dyv = randn(NV, V, grad=True), randn(NV, V)
    sm = lambda t: torch.softmax(t, -1)
    ys = mt.softmax_forward(logits)
    forward = {"meshfuse": lambda: mt.softmax_forward(logits), "eager": lambda: sm(logits)}
    backward = {"meshfuse": lambda: mt.softmax_backward(dyv, ys),
                "eager": grad_of(lambda: sm(logits), (logits,), dyv)}
    if device.type == "cpu":
        # The same kernels into outputs allocated once (see the module's docstring).
        xd, (y1, y2, g1, g2) = logits.detach(), (torch.empty_like(logits) for _ in range(4))
        forward["meshfuse out"] = lambda: meshfuse.softmax(xd, y1)
        forward["eager out"] = lambda: torch.ops.aten._softmax.out(xd, -1, False, out=y2)
        backward["meshfuse out"] = lambda: meshfuse.softmax_backward(dyv, ys, g1)
        backward["eager out"] = lambda: torch.ops.aten._softmax_backward_data.out(
            dyv, ys, -1, dtype, grad_input=g2)
    yield ("softmax", "forward", 2 * NV * V * e, forward, sm, (logits,))
    yield ("softmax", "backward", 3 * NV * V * e, backward, None, None)

    # cross_entropy
    labels = torch.randint(0, V, (NV,), generator=g, device=device)
    ce = lambda t, lab: F.cross_entropy(t, lab)
    loss, lse = mt.cross_entropy_forward(logits, labels)
    one = torch.ones((), device=device, dtype=dtype)
    yield ("cross_entropy", "forward", NV * V * e,
           {"meshfuse": lambda: mt.cross_entropy_forward(logits, labels),
            "eager": lambda: ce(logits, labels)}, ce, (logits, labels))
    yield ("cross_entropy", "backward", 2 * NV * V * e,
           {"meshfuse": lambda: mt.cross_entropy_backward(one, logits, labels, lse),
            "eager": grad_of(lambda: ce(logits, labels), (logits,), one)}, None, None)


def linear_cases(cfg, tokens, dtype, device):
    """(op, direction, flops, {impl: fn}, ref, args) for the layer's linears: meshfuse's linear
    (cuBLASLt on a GPU) against F.linear (torch.matmul's cuBLAS path) at the same shapes."""
    from meshfuse import _meshfuse as C

    g = torch.Generator(device=device).manual_seed(1)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (
        cfg.get("head_dim") or H // cfg["num_attention_heads"])
    stream = (lambda: torch.cuda.current_stream().cuda_stream) if device.type == "cuda" else (
        lambda: 0)
    for name, n_out, k in (("linear_q", H, H), ("linear_kv", kv, H), ("linear_gate", I, H),
                           ("linear_down", H, I)):
        x = torch.randn(tokens, k, generator=g, device=device, dtype=dtype).requires_grad_(True)
        w = (torch.randn(n_out, k, generator=g, device=device, dtype=dtype) / k ** 0.5
             ).requires_grad_(True)
        dy = torch.randn(tokens, n_out, generator=g, device=device, dtype=dtype)
        out = torch.empty(tokens, n_out, device=device, dtype=dtype)
        gx, gw = torch.empty_like(x), torch.empty_like(w)
        xd, wd = x.detach(), w.detach()
        flops = 2 * tokens * n_out * k
        yield (name, "forward", flops,
               {"meshfuse": lambda xd=xd, wd=wd, out=out: C.linear(xd, wd, None, out, stream()),
                "eager": lambda x=x, w=w: F.linear(x, w)}, None, None)  # compile: cuBLAS too
        y = F.linear(x, w)
        yield (name, "backward", 2 * flops,
               {"meshfuse": lambda dy=dy, xd=xd, wd=wd, gx=gx, gw=gw: C.linear_backward(
                   dy, xd, wd, gx, gw, None, stream()),
                "eager": lambda y=y, x=x, w=w, dy=dy: torch.autograd.grad(
                    y, (x, w), dy, retain_graph=True)}, None, None)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, default=None,
                   help="rows of the hidden-size ops (default 4096 on cpu, 16384 on cuda)")
    p.add_argument("--vocab-tokens", type=int, default=None,
                   help="rows of the vocabulary ops (default: 256 on cpu, --tokens on cuda)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--ops", default="", help="comma-separated subset")
    p.add_argument("--compile", action="store_true", help="also time torch.compile")
    p.add_argument("--seconds", type=float, default=1.0, help="time per case (min)")
    p.add_argument("--calls", type=int, default=20, help="timed calls per implementation (min)")
    p.add_argument("--json", default="", help="write the records here")
    a = p.parse_args()
    device = torch.device(a.device)
    tokens = a.tokens or (16384 if a.device == "cuda" else 4096)
    vocab_tokens = a.vocab_tokens or (tokens if a.device == "cuda" else 256)
    dtype = DTYPES[a.dtype]
    timer = Timer(device)
    cfg = load_model(a.model)
    wanted = set(filter(None, a.ops.split(",")))

    peak = copy_bandwidth(device, timer)
    threads = torch.get_num_threads()
    print(f"# {a.model} {a.dtype} on {device} (torch {torch.__version__}, {threads} threads); "
          f"hidden-size ops {tokens} rows, vocabulary ops {vocab_tokens} rows; measured copy "
          f"bandwidth {peak:.1f} GB/s", flush=True)
    print(f"{'op':28} {'dir':8} {'impl':12} {'median ms':>10} {'p20':>9} {'p80':>9} "
          f"{'GB/s|TF/s':>8} {'of copy':>8} {'meshfuse x':>10}")
    records = []
    memory_bound = ((c, "bytes") for c in cases(cfg, tokens, dtype, device, vocab_tokens))
    # The linears take seconds per call on a CPU: there only when --ops names them.
    with_gemms = a.device == "cuda" or any(op.startswith("linear") for op in wanted)
    gemms = ((c, "flops") for c in linear_cases(cfg, tokens, dtype, device)) if with_gemms else ()
    for (op, direction, work, impls, fn, args), unit in itertools.chain(memory_bound, gemms):
        if wanted and op not in wanted and not (op.startswith("linear") and "linear" in wanted):
            continue
        if a.compile and fn is not None:
            compiled = torch.compile(fn)
            impls["compile"] = lambda compiled=compiled, args=args: compiled(*args)
        times = measure(impls, timer, a.calls, a.seconds)
        for name, ms in times.items():
            med, p20, p80 = stats(ms)
            rate = work / (med * 1e-3) / (1e9 if unit == "bytes" else 1e12)
            speedup = med / statistics.median(
                times["meshfuse out" if name.endswith(" out") else "meshfuse"])
            rated = (f"{rate:8.1f} {rate / peak:8.1%}" if unit == "bytes"
                     else f"{rate:7.2f}T {'-':>8}")
            print(f"{op:28} {direction:8} {name:12} {med:10.4f} {p20:9.4f} {p80:9.4f} "
                  f"{rated} {speedup:10.2f}", flush=True)
            records.append(dict(op=op, direction=direction, impl=name, device=a.device,
                                dtype=a.dtype, median_ms=med, p20_ms=p20, p80_ms=p80,
                                **({"gbps": rate, "fraction_of_copy": rate / peak}
                                   if unit == "bytes" else {"tflops": rate}),
                                meshfuse_speedup=speedup, copy_gbps=peak))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
