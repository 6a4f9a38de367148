#!/usr/bin/env python3
"""A training step of a few-layer llama-3.1-8b-shaped Hugging Face model (random weights, nothing
downloaded), unpatched and patched with meshfuse.torch.patch (and with Liger-Kernel's
apply_liger_kernel_to_llama when liger_kernel is installed): tokens/s and peak memory.

Each variant gets a fresh model from the same seed; a step is forward + backward + zeroing the
gradients (no optimizer: its memory is the same for all). Timed over --steps steps after
--warmup, each on CUDA events (median and p20-p80 over steps). Peak memory over the timed steps:
torch's (torch.cuda.max_memory_allocated) plus meshfuse's pool (meshfuse.device_memory_stats'
peak_allocated: meshfuse's ops allocate their scratch there, e.g. fused_linear_cross_entropy's chunk
of fp32 logits, which torch's counters do not see). The sum bounds their peak together from above:
the pool holds an op's scratch only while the op runs.

    python3 bench/hf_patch.py --layers 2 --tokens 8192 --json hf_patch.json
"""

import argparse
import gc
import json
import statistics
import sys

import torch

import meshfuse
import meshfuse.torch as mt


def llama_8b_config(layers):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16")


def variants():
    out = {"unpatched": lambda model: model, "meshfuse": mt.patch,
           # lm_head's weight gradient summed in bf16 (no fp32 copy of it), as Liger's default.
           "meshfuse_bf16_accum": lambda model: mt.patch(model, accum_dtype=torch.bfloat16)}
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance as liger
        out["liger"] = lambda model: liger(model=model) or model
        # What meshfuse.torch.patch swaps (RMSNorm, SwiGLU, the loss): Liger without its RoPE.
        out["liger_no_rope"] = lambda model: liger(model=model, rope=False) or model
    except ImportError:
        pass
    return out


def run(name, patch, args):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(llama_8b_config(args.layers))
    model = patch(model.to(device="cuda", dtype=torch.bfloat16))
    model.train()
    batch = args.tokens // args.sequence
    ids = torch.randint(0, model.config.vocab_size, (batch, args.sequence), device="cuda")

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    pool = f"cuda:{torch.cuda.current_device()}"
    meshfuse.reset_peak_memory_stats(pool)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    events[0].record()
    for e in events[1:]:
        loss = step()
        e.record()
    events[-1].synchronize()
    ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    q = statistics.quantiles(ms, n=5) if len(ms) > 1 else [ms[0], ms[0]]
    step_ms = statistics.median(ms)
    torch_gib = torch.cuda.max_memory_allocated() / 2**30
    pool_gib = meshfuse.device_memory_stats(pool)["peak_allocated"] / 2**30
    return {"variant": name, "layers": args.layers, "tokens": batch * args.sequence,
            "tokens_per_s": batch * args.sequence / step_ms * 1e3, "step_ms": step_ms,
            "step_p20_ms": q[0], "step_p80_ms": q[-1], "torch_peak_gib": torch_gib,
            "meshfuse_pool_peak_gib": pool_gib, "peak_gib": torch_gib + pool_gib,
            "loss": float(loss.detach())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sequence", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", help="comma-separated, of unpatched, meshfuse, "
                        "meshfuse_bf16_accum, liger, liger_no_rope (those of Liger when "
                        "liger_kernel is installed); default all")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("hf_patch: no CUDA device; nothing to measure")
        return 0
    known = variants()
    names = args.variants.split(",") if args.variants else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; this machine has "
                     f"{', '.join(known)}")
    rows = []
    for name in names:
        rows.append(run(name, known[name], args))
        gc.collect()  # the last variant's model, before the next one's peak
        torch.cuda.empty_cache()
    print(f"{'variant':<20} {'tokens/s':>10} {'step ms':>9} {'torch GiB':>10} {'pool GiB':>9} "
          f"{'peak GiB':>9} {'loss':>8}")
    for r in rows:
        print(f"{r['variant']:<20} {r['tokens_per_s']:>10.0f} {r['step_ms']:>9.1f} "
              f"{r['torch_peak_gib']:>10.2f} {r['meshfuse_pool_peak_gib']:>9.2f} "
              f"{r['peak_gib']:>9.2f} {r['loss']:>8.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
