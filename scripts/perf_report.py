#!/usr/bin/env python3
"""Stores benchmark runs in docs/results/ and generates docs/PERFORMANCE.md from them.

    scripts/perf_report.py add --machine M --command C [--kind K] [--commit X] [--date D] FILE.json
    scripts/perf_report.py            # regenerate docs/PERFORMANCE.md from docs/results/*.json

A stored run wraps a tool's JSON output with its metadata:
    {"machine", "command", "commit", "date", "kind", "results": <the tool's JSON>}
Kinds: bench (`meshfuse bench --format json`), comm_bench (`meshfuse comm-bench --format json`),
run (`meshfuse run --format json`), torch_compare, recurrent_compare, flce_compare, comm_compare,
numerics (the --json files of bench/*.py), executor_overhead (bench/executor_overhead --json),
overlap (bench/overlap --json), python_overhead (bench/python_overhead.py --json), op_overhead
(bench/op_overhead --json), hf_patch (bench/hf_patch.py --json).
Standard library only.
"""

import argparse
import datetime
import functools
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
REPORT = os.path.join(ROOT, "docs", "PERFORMANCE.md")
KINDS = ("bench", "comm_bench", "run", "torch_compare", "recurrent_compare", "flce_compare",
         "comm_compare", "numerics", "executor_overhead", "overlap", "python_overhead",
         "op_overhead", "hf_patch")


def guess_kind(results):
    """The kind of a tool's JSON output, from its shape."""
    if isinstance(results, dict):
        return "flce_compare" if "ratios" in results else "run" if "per_rank" in results else None
    first = results[0] if results else {}
    if "executor_us" in first:
        return "executor_overhead"
    if "meshfuse_us" in first:
        return "python_overhead"
    if "per_floor" in first:
        return "op_overhead"
    if "tokens_per_s" in first:
        return "hf_patch"
    if first.get("layer") in ("ag_gemm", "gemm_rs", "chunked_gemm"):
        return "overlap"
    if "meshfuse_err" in first:
        return "numerics"
    if "impl" in first:
        return "recurrent_compare" if "head_dim" in first else "torch_compare"
    if "torch" in first and "meshfuse" in first:
        return "comm_compare"
    if "busbw_gbps" in first:
        return "comm_bench"
    if "fraction_of_peak" in first:
        return "bench"
    return None


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower())[:40].strip("-")


@functools.cache
def commits_before(commit):
    """How many commits lead to `commit` (0 where git does not know it): of one day's runs, the
    later commit's come first."""
    found = subprocess.run(["git", "-C", ROOT, "rev-list", "--count", commit],
                           capture_output=True, text=True)
    return int(found.stdout) if found.returncode == 0 else 0


def add(args):
    with open(args.file) as f:
        results = json.load(f)
    kind = args.kind or guess_kind(results)
    if kind not in KINDS:
        sys.exit(f"perf_report.py: cannot tell the kind of {args.file}: give --kind, one of "
                 f"{', '.join(KINDS)}")
    commit = args.commit or subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                           check=True, capture_output=True,
                                           text=True).stdout.strip()
    date = args.date or datetime.date.today().isoformat()
    run = {"machine": args.machine, "command": args.command, "commit": commit, "date": date,
           "kind": kind, "results": results}
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"{date}-{commit}-{slug(args.machine)}-{kind}")
    path, n = f"{stem}.json", 2
    while os.path.exists(path):  # another run of the same kind, commit and machine
        path, n = f"{stem}-{n}.json", n + 1
    with open(path, "w") as f:
        json.dump(run, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"stored {os.path.relpath(path, ROOT)}; run scripts/perf_report.py to regenerate "
          f"{os.path.relpath(REPORT, ROOT)}")


# --- formatting --------------------------------------------------------------------------------


def num(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"


def pct(v):
    return "-" if v is None else f"{v:.1%}"


def tflops(v):
    return f"{v:.3g} TFLOP/s" if v < 100 else f"{v:.0f} TFLOP/s"


def sci(v):
    return "-" if v is None else f"{v:.3e}"


def ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def spread(r, key="p20_ms", hi="p80_ms", digits=3):
    return f"{r[key]:.{digits}f}-{r[hi]:.{digits}f}"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def bench_section(results):
    """meshfuse bench --format json: one row per op and direction."""
    rows = []
    for r in results:
        rate = (f"{r['gbps']:.1f} GB/s" if r.get("gbps") is not None
                else tflops(r["tflops"]) if r.get("tflops") is not None else "-")
        rows.append([r["op"], r["direction"], r["shape"], r["backend"], r["dtype"],
                     num(r["median_ms"]), spread(r), rate, pct(r.get("fraction_of_peak")),
                     r["status"]])
    out = table(["op", "direction", "shape", "backend", "dtype", "median ms", "p20-p80 ms",
                 "rate", "of limit", "status"], rows)
    # The run's copy bandwidth: any memory-bound row's GB/s over its fraction of it.
    copies = [r["gbps"] / r["fraction_of_peak"] for r in results
              if r.get("gbps") and r.get("fraction_of_peak")]
    notes = ["", "Limit: the copy bandwidth measured in the same run for memory-bound ops"
             + (f" ({copies[0]:.1f} GB/s)" if copies else "")
             + "; for GEMMs, the vendor GEMM at the same shape timed interleaved (no figure on "
             "a GPU). Byte and FLOP formulas: [BENCHMARKING.md](BENCHMARKING.md)."]
    return out + notes


def torch_compare_section(results):
    """bench/torch_compare.py --json: one row per op, direction and implementation."""
    rows = []
    for r in results:
        rate = f"{r['gbps']:.1f} GB/s" if "gbps" in r else tflops(r["tflops"])
        rows.append([r["op"], r["direction"], r["impl"], r["dtype"], num(r["median_ms"], 4),
                     spread(r, digits=4), rate, pct(r.get("fraction_of_copy")),
                     ratio(r["meshfuse_speedup"])])
    copy = results[0].get("copy_gbps") if results else None
    return table(["op", "direction", "impl", "dtype", "median ms", "p20-p80 ms", "rate", "of copy",
                  "meshfuse speed-up"], rows) + [
        "", "Speed-up: this implementation's median over meshfuse's, or over \"meshfuse out\"'s "
        "for the rows into outputs allocated once (above 1: meshfuse is faster)" + (f"; copy bandwidth {copy:.1f} GB/s, measured by the script." if copy else ".")]


def recurrent_compare_section(results):
    """bench/recurrent_compare.py --json: one row per op, H, direction and implementation."""
    rows = [[r["op"], r["head_dim"], r["direction"], r["impl"], r["dtype"],
             f"{r['batch']} x {r['seq_len']} x {r['heads']}", num(r["median_ms"]), spread(r),
             num(r["us_per_step"], 2), pct(r.get("fraction_of_copy")), ratio(r["meshfuse_speedup"])]
            for r in results]
    return table(["op", "H", "direction", "impl", "dtype", "B x S x N", "median ms", "p20-p80 ms",
                  "us per step", "of copy", "meshfuse speed-up"], rows)


def flce_compare_section(results):
    """bench/flce_compare.py --json: medians, peak extra memory and the ratios."""
    a = results["args"]
    out = [f"N = {a['tokens']}, V = {a['vocab']}, H = {a['hidden']}, {a['dtype']}, grad_weight "
           f"{a['grad_weight_dtype']}, device {results['device']}", ""]
    memory = results.get("memory", {})
    rows = [[k, num(ms, 2),
             num(memory[k]["extra_bytes"] / 2**30) if k in memory else "-"]
            for k, ms in results["median_ms"].items()]
    out += table(["implementation", "median ms", "peak extra GiB"], rows) + [""]
    out += table(["ratio", "value"], [[k, num(v)] for k, v in results["ratios"].items()])
    return out


def comm_compare_section(results):
    """bench/comm_compare.py --json: meshfuse's nccl against torch.distributed per size."""
    rows = [[r["op"], r["bytes"], num(r["torch"]["busbw_gbps"], 2),
             num(r["meshfuse"]["busbw_gbps"], 2), num(r["ratio"]), num(r["torch"]["median_us"], 1),
             num(r["meshfuse"]["median_us"], 1)] for r in results]
    return table(["op", "bytes", "torch busbw GB/s", "meshfuse busbw GB/s", "ratio", "torch us",
                  "meshfuse us"], rows)


def comm_bench_section(results):
    """meshfuse comm-bench --format json: one row per message size."""
    rows = [[r["op"], r["backend"], r["dtype"], r["ranks"], r["bytes"], num(r["median_us"], 1),
             spread(r, "p20_us", "p80_us", 1), num(r["algbw_gbps"]), num(r["busbw_gbps"])]
            for r in results]
    return table(["op", "backend", "dtype", "ranks", "bytes", "median us", "p20-p80 us",
                  "algbw GB/s", "busbw GB/s"], rows)


def numerics_section(results):
    """bench/numerics.py --json: one row per op, direction, output and dtype."""
    rows = []
    for r in results:
        op = r["op"] + (f" ({r['variant']})" if r["variant"] else "")
        # The dtype meshfuse wrote where it is not the one under test (an f32 loss or gradient).
        output = r["output"] + ("" if r["meshfuse_dtype"] == r["dtype"]
                                else f" [{r['meshfuse_dtype']}]")
        rows.append([op, r["direction"], output, r["dtype"], r["device"], sci(r["meshfuse_err"]),
                     sci(r["torch_err"]), ratio(r["ratio"]), "worse" if r["worse"] else ""])
    worse = sum(r["worse"] for r in results)
    return ["Error of an output: `max |out - truth| / max(|truth|, 2^-10 max|truth|)` over its "
            "elements, the truth computed in fp64 from the same inputs rounded to the dtype "
            "([BENCHMARKING.md](BENCHMARKING.md#numerics)). Ratio: meshfuse's error over PyTorch "
            "eager's; worse: meshfuse's is the larger (the goal is none).", ""] + table(
        ["op", "direction", "output", "dtype", "device", "meshfuse error", "torch error", "ratio",
         "mark"], rows) + ["", f"meshfuse's error is the larger on {worse} of {len(results)} rows."]


def overlap_section(results):
    """bench/overlap --json: one tensor-parallel layer with overlap none, collective and ring."""
    def med(r, key):
        return f"{num(r[key + '_ms'])} [{spread(r, key + '_p20_ms', key + '_p80_ms')}]"

    layers = [r for r in results if r["layer"] != "chunked_gemm"]
    costs = [r for r in results if r["layer"] == "chunked_gemm"]
    rows = [[r["layer"], r["device"], r["ranks"], r["dtype"], f"{r['m']}x{r['k']}x{r['n']}",
             num(r["comm_ms"]), num(r["compute_ms"]), med(r, "none"), med(r, "collective"),
             med(r, "ring"), num(r["collective_efficiency"], 2),
             num(r["ring_efficiency"], 2), ratio(r["none_ms"] / r["collective_ms"]),
             ratio(r["none_ms"] / r["ring_ms"])] for r in layers]
    out = ["Rank 0's time per run (ms, median [p20-p80]); ranks are threads on the local backend. "
           "comm and compute: the steps of a run without overlap, each timed with the stream "
           "synchronised. Efficiency: max(comm, compute) / overlapped (goal: at least 0.9 on the "
           "GPU). Speed-up: none / overlapped.", ""] + table(
        ["layer", "device", "ranks", "dtype", "m x k x n", "comm", "compute", "none",
         f"collective ({layers[0]['chunks'] if layers else ''} chunks)", "ring", "eff. coll.",
         "eff. ring", "speed-up coll.", "speed-up ring"], rows)
    if costs:
        out += ["", "Chunking cost: rank 0's GEMM of ag_gemm on one device as one call, and as "
                "chunks x ranks calls on row blocks (goal: within 3% at 4 chunks).", ""]
        out += table(["device", "dtype", "m x k x n/ranks", "blocks", "one GEMM ms", "blocks ms",
                      "extra"],
                     [[c["device"], c["dtype"], f"{c['m']}x{c['k']}x{-(-c['n'] // c['ranks'])}",
                       c["chunks"] * c["ranks"], med(c, "one_gemm"), med(c, "chunked"),
                       pct(c["chunked_ms"] / c["one_gemm_ms"] - 1)] for c in costs])
    return out


def run_section(results):
    """meshfuse run --format json: per-rank and one-device time, collectives, checks."""
    r = results
    out = [f"{r['model']}, {r['tokens']} tokens, {r['dtype']}, {r['ranks']} rank(s) on "
           f"{r['backend']} ({r['device']}), forward + backward, median of {r['repeats']} runs: "
           f"one device {num(r['single_device_ms'], 2)} ms, scaling efficiency "
           f"{num(r['scaling_efficiency'], 2)} (one device / (ranks x per rank)); every check "
           f"{'passes' if r['pass'] else 'DOES NOT pass'}."
           + (" The ranks are threads sharing the machine's cores, and the one-device run has all "
              "of them: with N ranks on C cores the efficiency is at most C / N."
              if r["backend"] == "local" else ""), ""]
    out += table(["rank", "median ms", "in communication ms", "share"],
                 [[p["rank"], num(p["median_ms"], 2), num(p["comm_ms"], 2),
                   pct(p["comm_ms"] / p["median_ms"] if p["median_ms"] else 0)]
                  for p in r["per_rank"]]) + [""]
    out += table(["communication (rank 0)", "bytes", "median ms"],
                 [[c["communication"], c["bytes"], num(c["median_ms"])]
                  for c in r.get("collectives", [])]) + [""]
    if r.get("layers"):
        o = r["overlap"]
        out += [f"Overlap {o['form']} ({o['chunks'] or r['ranks']} chunks, {o['streams']} streams): "
                "each stretch's comm and compute alone (steps of a profiled run without overlap), "
                "their sum, the stretch overlapped, and max(comm, compute) / overlapped.", ""]
        out += table(["stretch", "comm ms", "compute ms", "sequential ms", "overlapped ms",
                      "efficiency"],
                     [[l["stretch"], num(l["comm_ms"]), num(l["compute_ms"]),
                       num(l["sequential_ms"]), num(l["overlapped_ms"]),
                       num(l["overlap_efficiency"], 2)] for l in r["layers"]]) + [""]
    out += table(["output", "max abs err", "normwise err", "check"],
                 [[c["output"], sci(c["max_abs_err"]), sci(c["normwise_err"]),
                   "pass" if c["pass"] else "FAIL"] for c in r["checks"]])
    return out


def executor_overhead_section(results):
    """bench/executor_overhead --json: a one-op program through the executor against the op."""
    rows = [[r["op"], r["dtype"], r["device"], str(r["shape"]), num(r["direct_us"], 2),
             f"{num(r['direct_p20_us'], 2)}-{num(r['direct_p80_us'], 2)}",
             num(r["executor_us"], 2),
             f"{num(r['executor_p20_us'], 2)}-{num(r['executor_p80_us'], 2)}",
             num(r["executor_us"] - r["direct_us"], 2),
             pct((r["executor_us"] - r["direct_us"]) / r["direct_us"])] for r in results]
    return ["Host time per call (a GPU's queued calls synchronised once per round), median and "
            "p20-p80 over rounds; the goal: at most 5% or 5 us more.", ""] + table(
        ["op", "dtype", "device", "shape", "direct us", "p20-p80", "executor us", "p20-p80",
         "extra us", "extra"], rows)


def python_overhead_section(results):
    """bench/python_overhead.py --json: meshfuse.torch's host time per call against PyTorch's."""
    def spread(r, impl):
        if f"{impl}_us" not in r:  # no torch extension in that build (or a run before it)
            return ["-", "-"]
        return [num(r[f"{impl}_us"], 2), f"{num(r[f'{impl}_p20_us'], 2)}-{num(r[f'{impl}_p80_us'], 2)}"]

    rows = [[r["op"], r["dtype"], r["device"], str(r["shape"]), *spread(r, "meshfuse"),
             *spread(r, "dlpack"), *spread(r, "torch"), f"{r['ratio']:.2f}x"] for r in results]
    return ["Host time per call on tiny inputs (on a GPU, synchronised once per round of calls), "
            "median and p20-p80 over rounds, meshfuse.torch against PyTorch's matching call in "
            "the same run; the goal: a ratio (meshfuse / torch) of at most 1.2. \"dlpack\": the "
            "same calls with meshfuse's torch extension off, the path of a build without torch (\"-\": "
            "a run without the extension or before it). A row named plain \"cross_entropy\" "
            "(runs before d720fe7) is label_check=\"raise\", then meshfuse.torch's default.",
            ""] + table(
        ["op", "dtype", "device", "shape", "meshfuse us", "p20-p80", "dlpack us", "p20-p80",
         "torch us", "p20-p80", "ratio"], rows)


def op_overhead_section(results):
    """bench/op_overhead --json: the ops' C++ entries on a GPU against one launch."""
    rows = [[r["op"], r["dtype"], str(r["shape"]), num(r["us"], 2),
             f"{num(r['p20_us'], 2)}-{num(r['p80_us'], 2)}", f"{r['per_floor']:.2f}x"]
            for r in results]
    return ["Host time per call of the C++ entry on tiny inputs, queued on one stream and "
            "synchronised once per round (a kernel slower than the host shows its own time), "
            "median and p20-p80 over rounds, against one launch of a kernel that does nothing.",
            ""] + table(["op", "dtype", "shape", "us", "p20-p80", "of one launch"], rows)


def hf_patch_section(results):
    """bench/hf_patch.py --json: a Hugging Face model's training step, unpatched and patched."""
    base = next((r for r in results if r["variant"] == "unpatched"), results[0])
    # Runs before the pool was counted stored torch's peak alone as peak_gib.
    pool = [r.get("meshfuse_pool_peak_gib") for r in results]
    rows = [[r["variant"], str(r["layers"]), str(r["tokens"]), num(r["step_ms"], 1),
             f"{num(r['step_p20_ms'], 1)}-{num(r['step_p80_ms'], 1)}",
             f"{r['tokens_per_s']:.0f}", f"{base['step_ms'] / r['step_ms']:.2f}x",
             num(r.get("torch_peak_gib", r["peak_gib"]), 2),
             "not measured" if p is None else num(p, 2),
             num(r["peak_gib"], 2) if p is not None else "-", f"{r['loss']:.4f}"]
            for r, p in zip(results, pool)]
    return ["A training step (forward, backward, zeroed gradients; random weights) of a "
            "llama-3.1-8b-shaped model with few layers, median and p20-p80 over steps; speed-up "
            "against the unpatched model in the same run. Peak memory: torch's allocator's, "
            "meshfuse's pool's (its ops' scratch, which torch does not count), and their sum, "
            "an upper bound of the two together.", ""] + table(
        ["variant", "layers", "tokens", "step ms", "p20-p80", "tokens/s", "speed-up",
         "torch peak GiB", "meshfuse pool GiB", "peak GiB", "loss"], rows)


SECTIONS = {"bench": bench_section, "run": run_section,
            "executor_overhead": executor_overhead_section, "comm_bench": comm_bench_section,
            "python_overhead": python_overhead_section, "op_overhead": op_overhead_section,
            "hf_patch": hf_patch_section,
            "overlap": overlap_section,
            "torch_compare": torch_compare_section,
            "recurrent_compare": recurrent_compare_section, "flce_compare": flce_compare_section,
            "comm_compare": comm_compare_section, "numerics": numerics_section}


def load_runs():
    runs = []
    for name in sorted(os.listdir(RESULTS)) if os.path.isdir(RESULTS) else []:
        if name.endswith(".json"):
            with open(os.path.join(RESULTS, name)) as f:
                run = json.load(f)
            missing = {"machine", "command", "commit", "date", "kind", "results"} - run.keys()
            if missing or run["kind"] not in SECTIONS:
                sys.exit(f"perf_report.py: docs/results/{name}: expected the keys machine, "
                         f"command, commit, date, kind (one of {', '.join(KINDS)}), results; "
                         f"missing {sorted(missing)}, kind {run.get('kind')!r}")
            run["file"] = name
            runs.append(run)
    return runs


def generate():
    runs = load_runs()
    lines = ["# Performance", "",
             "<!-- Generated by scripts/perf_report.py from docs/results/*.json: do not edit; "
             "rerun the script. -->", "",
             "Generated by `scripts/perf_report.py` from the runs stored in `docs/results/` (one "
             "JSON file per run, added with `scripts/perf_report.py add`). Each table is one run: "
             "its command, date, commit and machine head it. How the figures are measured: "
             "[BENCHMARKING.md](BENCHMARKING.md); how each kernel got there: "
             "[kernels/](kernels/README.md).", ""]
    machines = sorted({r["machine"] for r in runs})
    for machine in machines:
        lines += [f"## {machine}", ""]
        for run in sorted((r for r in runs if r["machine"] == machine),
                          key=lambda r: (r["date"], commits_before(r["commit"]), r["kind"],
                                         r["file"]), reverse=True):
            lines += [f"### {run['kind']}, {run['date']}, commit {run['commit']}", "",
                      f"Machine: {machine}. Date: {run['date']}. Commit: `{run['commit']}`. "
                      f"Command:", "", f"```sh\n{run['command']}\n```", ""]
            lines += SECTIONS[run["kind"]](run["results"])
            lines += ["", f"Source: `docs/results/{run['file']}`.", ""]
    if not runs:
        lines += ["No runs stored yet.", ""]
    with open(REPORT, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")
    print(f"wrote {os.path.relpath(REPORT, ROOT)} from {len(runs)} runs")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action")
    a = sub.add_parser("add", help="store a run's JSON in docs/results/")
    a.add_argument("--machine", required=True, help="e.g. 'NVIDIA H200, 143771 MiB, ...'")
    a.add_argument("--command", required=True, help="the command that produced the JSON")
    a.add_argument("--kind", choices=KINDS, help="default: recognised from the JSON")
    a.add_argument("--commit", help="default: git rev-parse --short HEAD")
    a.add_argument("--date", help="YYYY-MM-DD (default: today)")
    a.add_argument("file", help="the tool's JSON output")
    args = p.parse_args()
    if args.action == "add":
        add(args)
    else:
        generate()


if __name__ == "__main__":
    main()
