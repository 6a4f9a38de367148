#!/usr/bin/env python3
"""meshfuse's nccl backend against torch.distributed with NCCL, in one job on the same GPUs.

Every rank first times torch.distributed's collectives, then runs `meshfuse comm-bench --backend
nccl` (as a child process with the same rank environment and a fresh MASTER_PORT) for the same ops
and sizes; rank 0 prints both bus bandwidths per size and their ratio (meshfuse / torch).

Both sides measure the same way (apps/meshfuse/comm_bench.h): per iteration a barrier (a one-int
all_reduce queued on the stream, not waited for by the host), a ~100 us hold of the stream
so that the host queues the collective before it runs, CUDA events around the collective,
the slowest rank's time; median and p20/p80 over the iterations after the warm-up. Sizes and bus
bandwidth follow nccl-tests: size = the larger buffer of a rank (all_reduce: the tensor,
all_gather: the gathered output, reduce_scatter: the input); algbw = size / time; busbw = algbw x
2(n-1)/n for all_reduce and x (n-1)/n for all_gather and reduce_scatter.

    meshfuse launch -n 2 -- python3 bench/comm_compare.py --meshfuse build/apps/meshfuse/meshfuse
    torchrun --nproc-per-node 2 bench/comm_compare.py --meshfuse build/apps/meshfuse/meshfuse

scripts/comm_compare.sh runs it on a machine with two GPUs.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from rank_child import free_port, quantile, run_rank_child

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n}


def parse_bytes(text):
    units = {"": 0, "K": 10, "M": 20, "G": 30}
    digits = text.rstrip("KMGkmg")
    return int(digits) << units[text[len(digits):].upper()]


def torch_bench(op, sizes, dtype, iters, warmup, device):
    """Rows like comm-bench's JSON records, from torch.distributed."""
    n = dist.get_world_size()
    element = torch.tensor([], dtype=dtype).element_size()
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    rows = []
    for target in sizes:
        count = target // element // n * n
        if count == 0:
            continue
        big = torch.zeros(count, dtype=dtype, device=device)
        small = torch.zeros(count // n, dtype=dtype, device=device)
        call = {
            "all_reduce": lambda: dist.all_reduce(big),
            "all_gather": lambda: dist.all_gather_into_tensor(big, small),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(small, big),
        }[op]
        for _ in range(warmup):
            call()
        times = []
        for _ in range(iters):
            dist.all_reduce(flag)  # the barrier, queued on the stream like comm-bench's
            torch.cuda._sleep(200_000)  # ~100 us, as comm-bench's StreamTimer holds the stream
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)  # us
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        us = slowest.tolist()
        median = quantile(us, 0.5)
        algbw = count * element / (median * 1e3)
        rows.append({"op": op, "backend": "torch.distributed nccl", "bytes": count * element,
                     "count": count, "median_us": median, "p20_us": quantile(us, 0.2),
                     "p80_us": quantile(us, 0.8), "algbw_gbps": algbw,
                     "busbw_gbps": algbw * BUS[op](n)})
        del big, small
    return rows


def meshfuse_bench(args, op, port):
    """This rank's part of `meshfuse comm-bench`; rank 0 gets the JSON records."""
    command = [args.meshfuse, "comm-bench", "--backend", "nccl", "--op", op, "--dtype", args.dtype,
               "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--iters",
               str(args.iters), "--warmup", str(args.warmup), "--format", "json",
               "--no-copy-bandwidth"]
    return run_rank_child(command, port, "comm_compare")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--meshfuse", required=True, help="the meshfuse binary")
    parser.add_argument("--ops", default="all_reduce,all_gather",
                        help="comma-separated: all_reduce, all_gather, reduce_scatter")
    parser.add_argument("--min-bytes", default="1M")
    parser.add_argument("--max-bytes", default="1G")
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="ratios below 1 - tolerance are flagged")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()
    ops = args.ops.split(",")
    for op in ops:
        if op not in BUS:
            parser.error(f"--ops: unknown op '{op}' (all_reduce, all_gather, reduce_scatter)")

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes, size = [], parse_bytes(args.min_bytes)
    while size <= parse_bytes(args.max_bytes):
        sizes.append(size)
        size *= 2

    torch_rows = {op: torch_bench(op, sizes, DTYPES[args.dtype], args.iters, args.warmup, device)
                  for op in ops}
    # One fresh port for meshfuse's store, the same on every rank.
    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    torch.cuda.empty_cache()

    meshfuse_rows = {op: meshfuse_bench(args, op, port[0]) for op in ops}
    if rank != 0:
        return

    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    print(f"meshfuse nccl vs torch.distributed nccl (torch {torch.__version__}, its NCCL {nccl}), "
          f"{n} ranks on {torch.cuda.get_device_name(device)}, {args.dtype}, {args.iters} "
          f"iterations after {args.warmup} warm-up; busbw in GB/s (nccl-tests), median [p20, p80]")
    print(f"{'op':<15} {'bytes':>11} {'torch busbw':>12} {'meshfuse busbw':>15} {'ratio':>7}  "
          f"{'torch us [p20, p80]':>26}  {'meshfuse us [p20, p80]':>26}")
    rows, worst = [], None
    for op in ops:
        by_bytes = {r["bytes"]: r for r in meshfuse_rows[op]}
        for t in torch_rows[op]:
            m = by_bytes.get(t["bytes"])
            if m is None:
                continue
            ratio = m["busbw_gbps"] / t["busbw_gbps"]
            worst = ratio if worst is None else min(worst, ratio)
            flag = "  <" if ratio < 1 - args.tolerance else ""
            print(f"{op:<15} {t['bytes']:>11} {t['busbw_gbps']:>12.2f} {m['busbw_gbps']:>15.2f} "
                  f"{ratio:>7.3f}  {t['median_us']:>9.1f} [{t['p20_us']:.1f}, {t['p80_us']:.1f}]"
                  f"  {m['median_us']:>9.1f} [{m['p20_us']:.1f}, {m['p80_us']:.1f}]{flag}")
            rows.append({"op": op, "bytes": t["bytes"], "torch": t, "meshfuse": m, "ratio": ratio})
    if worst is not None:
        print(f"lowest ratio {worst:.3f}; '<' marks sizes more than {args.tolerance:.0%} below torch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
