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
    python3 bench/python_overhead.py --device cuda --breakdown   # where a call's time goes
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
        # PyTorch's semantics for a bad label (a device-side assert, no host wait), the default.
        ("cross_entropy (device_assert)", lambda: mt.cross_entropy(x, labels),
         lambda: F.cross_entropy(x, labels)),
        # A bad label raises from the call: the host waits for the device's check.
        ("cross_entropy (raise)", lambda: mt.cross_entropy(x, labels, label_check="raise"),
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


def breakdown(rows, hidden, dtype, device, calls, cuda):
    """Each step of meshfuse.torch.rmsnorm's eager path timed alone (us per call), to show where
    the host time of a call goes; PyTorch's whole call beside it."""
    from meshfuse import _meshfuse as C
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(hidden, generator=g).to(device=device, dtype=dtype)
    y = mt._empty_like(x)
    x0, y0 = x[:0], y[:0]  # no rows: everything but the kernel's launch
    stream = mt._stream(x)
    d = mt._d
    v1 = (1, 0)  # the versioned capsule nanobind asks a writable array's __dlpack__ for
    # The eager path's steps (no rstd: nothing will run the backward).
    steps = [
        ("eager-path checks", lambda: mt._untraced(x, w)),
        ("output allocation", lambda: mt._empty_like(x)),
        ("stream lookup", lambda: mt._stream(x)),
        ("DLPack export (3 tensors)", lambda: (d(x), d(w), d(y))),
        # By position, as the eager path calls it (keywords cost nanobind more).
        ("export + extension call", lambda: C.rmsnorm(d(x), d(w), d(y), None, 1e-5, stream)),
        # On CUDA all but the launch; the cpu kernel still widens the weight.
        ("the same on 0 rows (no launch)", lambda: C.rmsnorm(d(x0), d(w), d(y0), None, 1e-5,
                                                             stream)),
    ]
    if mt.has_torch_extension():  # the path meshfuse.torch takes with its torch extension
        steps += [
            ("torch extension call", lambda: mt._T.rmsnorm(x, w, 1e-5, False)),
            ("the same on 0 rows (no launch)", lambda: mt._T.rmsnorm(x0, w, 1e-5, False)),
        ]
    steps += [
        ("torch: one launch (y.zero_())", lambda: y.zero_()),
        # The floor of any op that allocates its output from Python: no meshfuse in it.
        ("torch: allocation + one launch", lambda: torch.empty_like(x).zero_()),
    ]
    if cuda:  # what a call that raises a device-side verdict adds: the launch's round trip
        event, on = torch.cuda.Event(), torch.cuda.current_stream(device)
        steps.append(("torch: one launch + event wait",
                      lambda: (y.zero_(), event.record(on), event.synchronize())))
    steps += [
        ("Tensor.__dlpack__ (3 tensors)", lambda: (x.__dlpack__(max_version=v1),
                                                   w.__dlpack__(max_version=v1),
                                                   y.__dlpack__(max_version=v1))),
        ("meshfuse.torch.rmsnorm", lambda: mt.rmsnorm(x, w, 1e-5)),
        ("torch rms_norm", lambda: F.rms_norm(x, (hidden,), w, 1e-5)),
    ]
    print(f"rmsnorm's host time by step, us per call (device {device}):")
    for name, fn in steps:
        fn()
        t = statistics.median(per_call_us(fn, calls, cuda) for _ in range(5))
        print(f"  {name:<32} {t:>8.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--breakdown", action="store_true",
                        help="time each step of rmsnorm's call instead")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.breakdown:
        with torch.inference_mode():
            breakdown(args.rows, args.hidden, dtype, device, args.calls, cuda)
        return

    # "meshfuse": as installed (the torch extension where it is built for this torch);
    # "dlpack": the same calls with the extension off (_meshfuse's DLPack path), for comparison.
    impls = ["meshfuse", "dlpack", "torch"] if mt.has_torch_extension() else ["meshfuse", "torch"]
    rows = []
    print(f"{'op':<30} " + " ".join(f"{i + ' us':>12}" for i in impls) +
          f" {'ratio':>7}  (device {device}, {args.rows} x {args.hidden} {args.dtype}, "
          f"{args.calls} calls x {args.rounds} rounds; ratio: meshfuse / torch)")
    extension = mt._T
    with torch.inference_mode():
        for name, ours, theirs in cases(args.rows, args.hidden, dtype, device):
            ours(), theirs()  # warm up: first-call work (op registration, allocator) left out
            times = {i: [] for i in impls}
            for _ in range(args.rounds):
                for impl in impls:
                    mt._T = None if impl == "dlpack" else extension
                    times[impl].append(per_call_us(theirs if impl == "torch" else ours,
                                                   args.calls, cuda))
            mt._T = extension
            med = {i: statistics.median(t) for i, t in times.items()}
            row = {"op": name, "device": str(device), "shape": [args.rows, args.hidden],
                   "dtype": args.dtype, "torch_extension": mt.has_torch_extension(),
                   "ratio": med["meshfuse"] / med["torch"]}
            for impl, t in times.items():  # the median and the spread over rounds
                q = statistics.quantiles(t, n=5) if len(t) > 1 else t
                row[f"{impl}_us"], row[f"{impl}_p20_us"], row[f"{impl}_p80_us"] = \
                    med[impl], q[0], q[-1]
            rows.append(row)
            print(f"{name:<30} " + " ".join(f"{med[i]:>12.2f}" for i in impls) +
                  f" {row['ratio']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
