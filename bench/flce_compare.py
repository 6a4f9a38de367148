#!/usr/bin/env python3
"""Fused linear cross-entropy against the unfused linear + cross_entropy: time and peak extra memory.

One training step of a language-model head, forward and backward (loss, grad_x, grad_weight; no
bias; reduction mean, upstream 1), in three ways on the same inputs:
  fused     meshfuse.fused_linear_cross_entropy (chunks of rows, no (N, V) logits)
  unfused   meshfuse linear -> cross_entropy -> cross_entropy_backward -> linear_backward, with the
            (N, V) logits and their gradient as torch tensors (the logits freed once their gradient
            is written: the least an unfused step needs, N x V x 2 dtype elements at once)
  torch     F.linear + F.cross_entropy with torch.autograd.grad (PyTorch eager)
and checks the issue's targets (N=16384, V=128256, H=4096, bf16 on an H200): fused peak extra
memory <= 20% of unfused, fused time <= 1.15x unfused.

Time: the median over --steps steps of each (interleaved: fused, unfused, torch, fused, ...), CUDA
events around each step (host clock on the CPU), after --warmup steps of each.

Peak extra memory (CUDA only), measured on one more step of each, from synchronised state:
  torch part: torch.cuda.max_memory_allocated() during the step minus memory_allocated() before
    (PyTorch's caching allocator: the unfused logits and gradient, torch's autograd buffers), minus
    the bytes of the outputs the step allocates itself (torch's grad_x and grad_weight; meshfuse's
    outputs are preallocated before the step), as if they were alive at the peak: a lower bound of
    torch's own extra, so the comparison is never tilted towards meshfuse;
  meshfuse part: the peak_allocated of meshfuse's pool (meshfuse.device_memory_stats: the CUDA
    stream-ordered pool meshfuse's ops allocate their scratch from, cuBLASLt workspaces included)
    during the step minus its allocated bytes before;
  extra = torch part + meshfuse part (the two peaks may fall at different moments: an upper bound
  of the combined peak). Inputs (x, weight, labels) and outputs (loss, grad_x, grad_weight) are not
  counted. "analytic unfused" is N x V x 2 elements of the dtype: the logits and their gradient.

    PYTHONPATH=<build>/python python3 bench/flce_compare.py                 # CUDA, issue's sizes
    PYTHONPATH=<build>/python python3 bench/flce_compare.py --device cpu     # small, any machine

Needs the meshfuse package on PYTHONPATH (<build>/python) and torch.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

import meshfuse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_compare import Timer  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
MEMORY_TARGET, TIME_TARGET = 0.20, 1.15


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--tokens", type=int, help="N (default: 16384 on CUDA, 256 on the CPU)")
    p.add_argument("--vocab", type=int, help="V (default: 128256 on CUDA, 4096 on the CPU)")
    p.add_argument("--hidden", type=int, help="H (default: 4096 on CUDA, 256 on the CPU)")
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    p.add_argument("--grad-weight-dtype", default="same", choices=["same", "f32"],
                   help="the fused op's grad_weight: the weight's dtype, or f32 (fp32 accumulation)")
    p.add_argument("--chunk-rows", type=int, default=0, help="0: the device's default")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args()
    cpu = a.device == "cpu"
    a.tokens = a.tokens or (256 if cpu else 16384)
    a.vocab = a.vocab or (4096 if cpu else 128256)
    a.hidden = a.hidden or (256 if cpu else 4096)
    return a


class Step:
    """One implementation: fn() runs a step; outputs() gives (loss, grad_x, grad_weight) of the
    last one; output_bytes is what a step allocates for its outputs (counted out of its extra);
    release() drops the outputs a step allocated (before measuring memory)."""

    def __init__(self, fn, outputs, output_bytes=0, release=lambda: None):
        self.fn, self.outputs, self.output_bytes, self.release = fn, outputs, output_bytes, release


def make_steps(a, device):
    dt = DTYPES[a.dtype]
    n, v, h = a.tokens, a.vocab, a.hidden
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, h, generator=g).to(device, dt)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(device, dt)  # logits ~ N(0, 1)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    one = torch.ones((), dtype=dt, device=device)
    stream = lambda: torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0

    # fused: outputs preallocated once.
    gw_dt = torch.float32 if a.grad_weight_dtype == "f32" else dt
    f_loss, f_dx = torch.empty((), dtype=dt, device=device), torch.empty_like(x)
    f_dw = torch.empty(v, h, dtype=gw_dt, device=device)

    def fused():
        meshfuse.fused_linear_cross_entropy(x, w, None, labels, one, f_loss, f_dx, f_dw, None,
                                            chunk_rows=a.chunk_rows, stream=stream())

    # unfused meshfuse: outputs preallocated; the intermediates are torch tensors of the step.
    u_loss, u_dx, u_dw = torch.empty((), dtype=dt, device=device), torch.empty_like(x), \
        torch.empty_like(w)

    def unfused():
        s = stream()
        logits = torch.empty(n, v, dtype=dt, device=device)
        lse = torch.empty(n, dtype=torch.float32 if dt in (torch.bfloat16, torch.float16)
                          else torch.float64, device=device)
        meshfuse.linear(x, w, None, logits, stream=s)
        meshfuse.cross_entropy(logits, labels, u_loss, lse, stream=s)
        dlogits = torch.empty_like(logits)
        meshfuse.cross_entropy_backward(one, logits, labels, lse, dlogits, stream=s)
        del logits
        meshfuse.linear_backward(dlogits, x, w, u_dx, u_dw, None, stream=s)

    # torch eager: autograd allocates its outputs (grad_x, grad_weight) in the step.
    xt, wt = x.detach().requires_grad_(), w.detach().requires_grad_()
    t_out = {}

    def eager():
        loss = F.cross_entropy(F.linear(xt, wt), labels)
        t_out["loss"] = loss.detach()
        t_out["dx"], t_out["dw"] = torch.autograd.grad(loss, [xt, wt])

    e = torch.tensor([], dtype=dt).element_size()
    return {
        "fused": Step(fused, lambda: (f_loss, f_dx, f_dw)),
        "unfused": Step(unfused, lambda: (u_loss, u_dx, u_dw)),
        "torch": Step(eager, lambda: (t_out["loss"], t_out["dx"], t_out["dw"]),
                      output_bytes=(n * h + v * h) * e, release=t_out.clear),
    }


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_extra(step, device):
    """(torch part, meshfuse part) in bytes of one step, as the module docstring says."""
    name = str(device)
    step.release()
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    meshfuse.reset_peak_memory_stats(name)
    torch_before = torch.cuda.memory_allocated(device)
    mf_before = meshfuse.device_memory_stats(name)["allocated"]
    step.fn()
    sync(device)
    torch_part = torch.cuda.max_memory_allocated(device) - torch_before - step.output_bytes
    mf_part = meshfuse.device_memory_stats(name)["peak_allocated"] - mf_before
    return max(torch_part, 0), mf_part


def max_rel_diff(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main():
    a = parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    steps = make_steps(a, device)
    gib = 2**30
    print(f"fused linear cross-entropy: N={a.tokens} V={a.vocab} H={a.hidden} {a.dtype}, "
          f"grad_weight {a.grad_weight_dtype}, chunk_rows {a.chunk_rows or 'default'}, "
          f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})")

    for _ in range(a.warmup):
        for s in steps.values():
            s.fn()
    sync(device)
    timer = Timer(device)
    times = {k: [] for k in steps}
    for _ in range(a.steps):
        for k, s in steps.items():
            times[k].append(timer(s.fn))

    # Agreement with torch eager (bf16 outputs: within a few bf16 ulps of the largest value).
    ref = steps["torch"].outputs()
    agree = {k: {o: max_rel_diff(x, r) for o, x, r in zip(("loss", "grad_x", "grad_weight"),
                                                        steps[k].outputs(), ref)}
             for k in ("fused", "unfused")}

    memory = {}
    if device.type == "cuda":
        for k, s in steps.items():
            t, m = peak_extra(s, device)
            memory[k] = {"torch_bytes": t, "meshfuse_bytes": m, "extra_bytes": t + m}

    e = torch.tensor([], dtype=DTYPES[a.dtype]).element_size()
    analytic = 2 * a.tokens * a.vocab * e
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'':8} {'median ms':>10} {'min ms':>8} {'peak extra GiB':>15} "
          f"{'(torch + meshfuse pool)':>24}")
    for k in steps:
        mem = memory.get(k)
        m = (f"{mem['extra_bytes'] / gib:15.3f} ({mem['torch_bytes'] / gib:8.3f} + "
             f"{mem['meshfuse_bytes'] / gib:7.3f})" if mem else f"{'n/a':>15}")
        print(f"{k:8} {med[k]:10.2f} {min(times[k]):8.2f} {m}")
    print(f"analytic unfused extra (logits + their gradient, N x V x 2 x {e} B): "
          f"{analytic / gib:.3f} GiB")
    for k in ("fused", "unfused"):
        print(f"{k} vs torch eager, max |diff| / max |torch|: " +
              ", ".join(f"{o} {d:.2e}" for o, d in agree[k].items()))

    ratios = {"time_vs_unfused": med["fused"] / med["unfused"],
              "time_vs_torch": med["fused"] / med["torch"]}
    if memory:
        fused_extra = memory["fused"]["extra_bytes"]
        ratios.update(memory_vs_unfused=fused_extra / memory["unfused"]["extra_bytes"],
                      memory_vs_torch=fused_extra / memory["torch"]["extra_bytes"],
                      memory_vs_analytic_unfused=fused_extra / analytic)
    print("targets (fused against meshfuse unfused):")
    if memory:
        r = ratios["memory_vs_unfused"]
        print(f"  peak extra memory {r:6.1%} of unfused (target <= {MEMORY_TARGET:.0%}): "
              f"{'met' if r <= MEMORY_TARGET else 'NOT met'}; {ratios['memory_vs_torch']:.1%} "
              f"of torch eager, {ratios['memory_vs_analytic_unfused']:.1%} of the analytic 2 N V")
    else:
        print("  peak extra memory: not measured on the CPU")
    r = ratios["time_vs_unfused"]
    print(f"  time {r:.3f}x unfused (target <= {TIME_TARGET}x): "
          f"{'met' if r <= TIME_TARGET else 'NOT met'}; {ratios['time_vs_torch']:.3f}x torch eager")

    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": str(device), "median_ms": med, "times_ms": times,
                       "memory": memory, "analytic_unfused_bytes": analytic, "ratios": ratios,
                       "agreement_with_torch": agree}, f, indent=2)


if __name__ == "__main__":
    main()
