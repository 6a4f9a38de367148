#!/usr/bin/env python3
"""Host time per call of meshfuse.torch's ops against the matching PyTorch calls, on tiny inputs
(4 x 4096 by default), where the kernels take a few microseconds and the host's work decides
(decoding, small-batch inference). Issue 19's target: within PyTorch's time + 20%.

Each implementation runs `--calls` calls in a row, timed on the host clock; rounds alternate the
implementations (A B A B ...) and the median round is reported, in microseconds per call. On
CUDA the device is synchronised after each round only, so the figure is what the host spends
queueing a call (the device keeps up on tiny inputs).

    python3 bench/python_overhead.py --device cpu
    python3 bench/python_overhead.py --device cuda --json overhead.json
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import meshfuse.torch as mt


def cases(rows, hidden, dtype, device):
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x, w, gate, up = randn(rows, hidden), randn(hidden), randn(rows, hidden), randn(rows, hidden)
    labels = torch.randint(0, hidden, (rows,), generator=g).to(device)
    # (name, meshfuse call, PyTorch call): forward only, no autograd graph (inference).
    return [
        ("rmsnorm", lambda: mt.rmsnorm(x, w, 1e-5), lambda: F.rms_norm(x, (hidden,), w, 1e-5)),
        ("softmax", lambda: mt.softmax(x), lambda: torch.softmax(x, -1)),
        ("swiglu", lambda: mt.swiglu(gate, up), lambda: F.silu(gate) * up),
        ("cross_entropy", lambda: mt.cross_entropy(x, labels),
         lambda: F.cross_entropy(x, labels)),
        ("rmsnorm_forward (raw)", lambda: mt.rmsnorm_forward(x, w, 1e-5),
         lambda: F.rms_norm(x, (hidden,), w, 1e-5)),
    ]


def per_call_us(fn, calls, cuda):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    rows = []
    print(f"{'op':<24} {'meshfuse us':>12} {'torch us':>10} {'ratio':>7}  (device {device}, "
          f"{args.rows} x {args.hidden} {args.dtype}, {args.calls} calls x {args.rounds} rounds)")
    with torch.inference_mode():
        for name, ours, theirs in cases(args.rows, args.hidden, dtype, device):
            ours(), theirs()  # warm up: first-call work (op registration, allocator) left out
            times = {"meshfuse": [], "torch": []}
            for _ in range(args.rounds):
                times["meshfuse"].append(per_call_us(ours, args.calls, cuda))
                times["torch"].append(per_call_us(theirs, args.calls, cuda))
            a, b = statistics.median(times["meshfuse"]), statistics.median(times["torch"])
            rows.append({"op": name, "device": str(device), "meshfuse_us": a, "torch_us": b,
                         "ratio": a / b})
            print(f"{name:<24} {a:>12.2f} {b:>10.2f} {a / b:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
