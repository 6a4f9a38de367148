#!/usr/bin/env python3
"""meshfuse's overlapped AG+GEMM and GEMM+RS against PyTorch's, in one job on the same GPUs.

Every rank first times PyTorch at each shape, then runs meshfuse's `bench/overlap --backend nccl`
(a child process with the same rank environment and a fresh MASTER_PORT) at the same shapes;
rank 0 prints one table and writes JSON.

The layers (global shapes; d ranks, bf16 by default):
  ag_gemm  x [m, k] sharded over rows, w [n, k] over rows: all_gather x, then x w^T [m, n/d]
  gemm_rs  x [m, k] sharded over k, w [n, k] over k: x w^T [m, n] partial sums, reduce_scatter
PyTorch's forms: sequential (dist.all_gather_into_tensor then torch.matmul; torch.matmul then
dist.reduce_scatter_tensor) and its async-TP fused ops (torch.ops.symm_mem.fused_all_gather_matmul,
fused_matmul_reduce_scatter, on symmetric memory). Both sides time a run the same way as
bench/overlap: the stream synchronised and the ranks met, wall clock until every rank's stream
is done again (the slowest rank). TFLOP/s counts the whole layer's 2 m k n over that time.

    meshfuse launch -n 2 -- python3 bench/overlap_compare.py --overlap build/bench/overlap

Keep NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 set (scripts/two_gpu.sh does).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from rank_child import free_port, quantile, run_rank_child

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def spread(ms):
    return {"ms": quantile(ms, 0.5), "p20_ms": quantile(ms, 0.2), "p80_ms": quantile(ms, 0.8)}


def timed(call, repeats, device):
    """ms per run from the ranks' meeting until the slowest rank's stream is done."""
    flag = torch.zeros(1, device=device)
    ms = []
    for r in range(repeats + 1):  # the first is a warm-up
        torch.cuda.synchronize(device)
        dist.all_reduce(flag)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        torch.cuda.synchronize(device)
        dist.all_reduce(flag)
        torch.cuda.synchronize(device)
        if r > 0:
            ms.append((time.perf_counter() - start) * 1e3)
    return ms


def torch_layers(args, device, group_name):
    d, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(rank)
    rows = []
    for n in args.n:
        # ag_gemm: this rank's rows of x and of w.
        x = torch.randn(args.m // d, args.k, device=device, dtype=dtype, generator=gen)
        w = torch.randn(n // d, args.k, device=device, dtype=dtype, generator=gen) * 0.02
        gathered = torch.empty(args.m, args.k, device=device, dtype=dtype)

        def ag_sequential():
            dist.all_gather_into_tensor(gathered, x)
            torch.matmul(gathered, w.t())

        def ag_fused():
            torch.ops.symm_mem.fused_all_gather_matmul(x, [w.t()], gather_dim=0,
                                                       group_name=group_name, return_A=False)

        # gemm_rs: this rank's columns of x and of w.
        xk = torch.randn(args.m, args.k // d, device=device, dtype=dtype, generator=gen)
        wk = torch.randn(n, args.k // d, device=device, dtype=dtype, generator=gen) * 0.02
        out = torch.empty(args.m // d, n, device=device, dtype=dtype)

        def rs_sequential():
            dist.reduce_scatter_tensor(out, torch.matmul(xk, wk.t()))

        def rs_fused():
            torch.ops.symm_mem.fused_matmul_reduce_scatter(xk, wk.t(), "sum", scatter_dim=0,
                                                           group_name=group_name)

        for layer, sequential, fused in (("ag_gemm", ag_sequential, ag_fused),
                                         ("gemm_rs", rs_sequential, rs_fused)):
            row = {"layer": layer, "n": n,
                   "torch_sequential": spread(timed(sequential, args.repeats, device))}
            try:
                row["torch_fused"] = spread(timed(fused, args.repeats, device))
            except (RuntimeError, AttributeError) as e:  # an older torch, or no symmetric memory
                row["torch_fused_error"] = str(e).splitlines()[0]
            rows.append(row)
        del x, w, gathered, xk, wk, out
        torch.cuda.empty_cache()
    return rows


def meshfuse_layers(args, port):
    """This rank's part of bench/overlap on nccl; rank 0 gets its JSON records."""
    command = [args.overlap, "--backend", "nccl", "--device", "cuda", "--json", "--m", str(args.m),
               "--k", str(args.k), "--n", ",".join(map(str, args.n)), "--chunks", str(args.chunks),
               "--repeats", str(args.repeats), "--dtype", args.dtype]
    return run_rank_child(command, port, "overlap_compare")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--overlap", required=True, help="meshfuse's bench/overlap binary")
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--n", type=lambda t: [int(v) for v in t.split(",")], default=[8192, 2048])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        enable_symm_mem_for_group(group_name)
    except (ImportError, RuntimeError) as e:
        print(f"overlap_compare: no symmetric memory ({e}); the fused ops will be missing",
              file=sys.stderr)
    rank, d = dist.get_rank(), dist.get_world_size()
    torch_rows = torch_layers(args, device, group_name)
    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    torch.cuda.empty_cache()

    ours = {(r["layer"], r["n"]): r for r in meshfuse_layers(args, port[0])
            if r["layer"] in ("ag_gemm", "gemm_rs")}
    if rank != 0:
        return
    print(f"{d} ranks on {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"{args.dtype}, m {args.m} k {args.k}, meshfuse on nccl with {args.chunks} chunks; ms per "
          f"run to the slowest rank, median of {args.repeats}; TFLOP/s of the whole layer")
    forms = ["torch_sequential", "torch_fused", "none", "collective", "ring"]
    print(f"{'layer':<8} {'n':>6} " + " ".join(f"{f:>17}" for f in forms) +
          f" {'eff coll':>9} {'eff ring':>9} {'best/torch seq':>15} {'best/torch fused':>17}")
    rows = []
    for t in torch_rows:
        m = ours.get((t["layer"], t["n"]))
        if m is None:
            continue
        ms = {"torch_sequential": t["torch_sequential"]["ms"],
              "torch_fused": t.get("torch_fused", {}).get("ms"),
              "none": m["none_ms"], "collective": m["collective_ms"], "ring": m["ring_ms"]}
        flop = 2.0 * args.m * args.k * t["n"]
        best = min(ms["collective"], ms["ring"], ms["none"])
        cells = [f"{v:8.3f} {flop / v / 1e9:6.0f}T" if v else f"{'-':>17}" for v in
                 (ms[f] for f in forms)]
        fused_ratio = f"{ms['torch_fused'] / best:17.3f}" if ms["torch_fused"] else f"{'-':>17}"
        print(f"{t['layer']:<8} {t['n']:>6} " + " ".join(cells) +
              f" {m['collective_efficiency']:>9.2f} {m['ring_efficiency']:>9.2f} "
              f"{ms['torch_sequential'] / best:>15.3f} {fused_ratio}")
        rows.append({"layer": t["layer"], "n": t["n"], "m": args.m, "k": args.k,
                     "dtype": args.dtype, "ranks": d, "torch": t, "meshfuse": m,
                     "tflops": {f: flop / v / 1e9 for f, v in ms.items() if v}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
