#!/usr/bin/env python3
"""meshfuse's and PyTorch eager's numerical error against fp64, for every op, direction and output.

For each dtype under test (f32, bf16, f16), on one device, on the same inputs:
  inputs    drawn in fp64 on the host with a fixed seed, the same on every device (standard
            normal; the weights of linear, the LM head and the recurrences N(0, 1/K) so that
            their products stay O(1); labels uniform in [0, V)), then rounded to the dtype;
  truth     the op in fp64 on the device from those rounded inputs, as PyTorch writes it (torch
            float64: F.rms_norm, F.cross_entropy, torch.matmul, ...; rnn and gru: the per-step
            loop of bench/recurrent_compare.py, the math of include/meshfuse/ops/recurrent.h);
  meshfuse  its kernels on the device, each output in the dtype, or in the dtype meshfuse is
            asked to write (--loss-dtype, --grad-weight-dtype);
  torch     the same PyTorch code run eagerly in the dtype on the device, with PyTorch's default
            settings (rnn and gru: the per-step loop, since PyTorch has no multi-head recurrence
            of this form; nn.RNN and nn.GRU add biases and gate differently).
Backward directions take an upstream gradient drawn and rounded the same way (1 for a scalar loss);
each implementation's backward uses what its own forward saved (meshfuse's rstd, lse, y or r;
autograd's graph), as in training. fused_linear_cross_entropy returns its loss and its gradients
from one call.

Error of an output: max over its elements of |out - truth| / max(|truth|, 2^-10 * max|truth|).
That is the relative error, except that elements below 2^-10 of the output's largest are measured
against that floor: their relative error says how close to zero they are, not how good the kernel
is. Ratio: meshfuse's error over PyTorch's; "worse" marks the rows where meshfuse's is larger,
however slightly (two outputs each within half an ulp can differ in the 5th digit).

    PYTHONPATH=<build>/python python3 bench/numerics.py --device cpu --json numerics-cpu.json
    PYTHONPATH=<build>/python python3 bench/numerics.py --device cuda --json numerics-cuda.json
    PYTHONPATH=<build>/python python3 bench/numerics.py --ops softmax,cross_entropy --dtypes bf16

Needs the meshfuse package on PYTHONPATH (<build>/python) and torch (bench/requirements.txt).
"""

import argparse
import json
import math
import os
import sys
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import meshfuse
import meshfuse.torch as mt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recurrent_compare import gru_step, rnn_step, torch_loop  # noqa: E402
from torch_compare import DTYPES  # noqa: E402

EPS = 1e-5  # rms_norm_eps of the LLaMA models
HEAD_DIM = 128  # of bmm's attention scores
BATCH, HEADS, STATE = 4, 8, 64  # rnn and gru: B sequences, N heads of H (--seq-len steps)
# Shapes: option -> (what it sets, default on the CPU, default on CUDA). The CPU run takes a few
# minutes on 2 cores; its GEMM-bound ops run on few rows because PyTorch's f16 matmul on a CPU
# without AVX512-FP16 runs at ~0.2 GFLOP/s.
SIZES = {"tokens": ("rows of rmsnorm, fused_residual_add_rmsnorm and swiglu", 2048, 16384),
         "hidden": ("H: their width, K and N of gemm and linear, the LM head's H", 4096, 4096),
         "vocab": ("V of softmax, cross_entropy and fused_linear_cross_entropy", 32768, 128256),
         "vocab_tokens": ("rows of softmax and cross_entropy", 256, 2048),
         "gemm_tokens": ("rows of gemm, bmm, linear and fused_linear_cross_entropy", 16, 4096),
         "seq_len": ("time steps of rnn and gru", 256, 1024)}


class Case(NamedTuple):
    """One op in one configuration. Its inputs' floating-point tensors are differentiated, in
    order (unless backward is False); their gradients are reported as grad_<name>."""
    op: str
    variant: str  # the options that tell two cases of one op apart ("" when it has one)
    inputs: Callable  # generator -> {name: fp64 tensor, or integer labels}, on the CPU
    outputs: tuple  # the names of the forward outputs
    reference: Callable  # (**inputs) -> output(s): PyTorch's code, the truth in fp64
    # (inputs on the device, upstream gradients by output) -> (outputs, gradients of the
    # floating inputs), in the orders above
    meshfuse: Callable
    backward: bool = True


def normal(gen, *shape, std=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * std


def stream_of(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def cases(a):
    """Every case, in a fixed order (a case's index seeds its draws)."""
    N, H, V, NV, M = a.tokens, a.hidden, a.vocab, a.vocab_tokens, a.gemm_tokens
    # The dtypes meshfuse is asked to write ("same": the input's): the loss of cross_entropy and
    # fused_linear_cross_entropy (and so its upstream gradient), fused_linear_cross_entropy's
    # parameter gradients.
    def loss_dtype(logits):
        return torch.float32 if a.loss_dtype == "f32" else logits.dtype

    def grad_weight_dtype(weight):
        return torch.float32 if a.grad_weight_dtype == "f32" else weight.dtype

    def draw_labels(gen, rows):
        return torch.randint(0, V, (rows,), generator=gen)

    def rmsnorm(t, g):
        y, _, rstd = mt.rmsnorm_forward(t["x"], t["weight"], EPS)
        grad_x, _, grad_weight = mt.rmsnorm_backward(g[0], t["x"], t["weight"], rstd, False)
        return (y,), (grad_x, grad_weight)

    def residual_rms_norm(x, residual, weight):
        r = x + residual
        return F.rms_norm(r, r.shape[-1:], weight, EPS), r

    def fused_residual_add_rmsnorm(t, g):
        y, r, rstd = mt.rmsnorm_forward(t["x"], t["weight"], EPS, residual=t["residual"])
        # At multiplier 1 grad_residual is grad_x (one tensor, as torch's add backward gives).
        grad_x, grad_residual, grad_weight = mt.rmsnorm_backward(g[0], r, t["weight"], rstd, True,
                                                                 grad_r=g[1])
        return (y, r), (grad_x, grad_residual, grad_weight)

    def swiglu(t, g):
        out = mt.swiglu_forward(t["gate"], t["up"])
        return (out,), mt.swiglu_backward(g[0], t["gate"], t["up"])

    def softmax(t, g):
        y = mt.softmax_forward(t["x"])
        return (y,), (mt.softmax_backward(g[0], y),)

    def cross_entropy(reduction):
        def run(t, g):
            logits, labels = t["logits"], t["labels"]
            loss = torch.empty((NV,) if reduction == "none" else (), dtype=loss_dtype(logits),
                               device=logits.device)
            sixteen_bit = logits.dtype in (torch.bfloat16, torch.float16)
            lse = torch.empty(NV, dtype=torch.float32 if sixteen_bit else torch.float64,
                              device=logits.device)
            grad_logits = torch.empty_like(logits)
            s = stream_of(logits)
            meshfuse.cross_entropy(logits, labels, loss, lse, reduction=reduction, stream=s)
            meshfuse.cross_entropy_backward(g[0].to(loss.dtype), logits, labels, lse, grad_logits,
                                            reduction=reduction, stream=s)
            return (loss,), (grad_logits,)

        return Case("cross_entropy", f"reduction={reduction}",
                    lambda gen: dict(logits=normal(gen, NV, V), labels=draw_labels(gen, NV)),
                    ("loss",),
                    lambda logits, labels: F.cross_entropy(logits, labels, reduction=reduction),
                    run)

    def fused_linear_cross_entropy(t, g):
        x, weight, bias = t["x"], t["weight"], t["bias"]
        loss = torch.empty((), dtype=loss_dtype(x), device=x.device)
        grads = (torch.empty_like(x), torch.empty_like(weight, dtype=grad_weight_dtype(weight)),
                 torch.empty_like(bias, dtype=grad_weight_dtype(weight)))
        meshfuse.fused_linear_cross_entropy(x, weight, bias, t["labels"], g[0].to(loss.dtype), loss,
                                            *grads, stream=stream_of(x))
        return (loss,), grads

    def matmul(kernel):  # gemm or bmm: (..., M, K) @ (..., K, N)
        def run(t, g):
            out = t["a"].new_empty(*t["a"].shape[:-1], t["b"].shape[-1])
            kernel(t["a"], t["b"], None, out, stream=stream_of(out))
            return (out,), ()
        return run

    def linear(t, g):
        x, weight, bias = t["x"], t["weight"], t["bias"]
        out = x.new_empty(x.shape[0], weight.shape[0])
        grads = (torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias))
        meshfuse.linear(x, weight, bias, out, stream=stream_of(x))
        meshfuse.linear_backward(g[0], x, weight, *grads, stream=stream_of(x))
        return (out,), grads

    def rnn(t, g):
        output, final_state = mt.rnn_forward(**t)
        return (output, final_state), mt.rnn_backward(g[0], g[1], output, t["input"].shape,
                                                      t["weight"], t["input_state"])

    def gru(t, g):
        output, final_state = mt.gru_forward(**t)
        return (output, final_state), mt.gru_backward(g[0], g[1], output, **t)

    def recurrent_inputs(*gates):
        """Draws rnn's or gru's inputs in the kernels' argument order: <gate>input and
        <gate>weight for each gate, then input_state."""
        def draw(gen):
            t = {}
            for gate in gates:
                t[gate + "input"] = normal(gen, BATCH, a.seq_len, HEADS, STATE)
                t[gate + "weight"] = normal(gen, HEADS, STATE, STATE, std=STATE ** -0.5)
            t["input_state"] = normal(gen, BATCH, HEADS, STATE, std=0.5)
            return t
        return draw

    def gru_loop(input, weight, forget_input, forget_weight, reset_input, reset_weight,
                 input_state):
        return torch_loop(gru_step, [input, forget_input, reset_input],
                          [weight, forget_weight, reset_weight], input_state)

    def linear_cross_entropy(x, weight, bias, labels):
        return F.cross_entropy(F.linear(x, weight, bias), labels)

    heads = H // HEAD_DIM
    return [
        Case("rmsnorm", "",
             lambda gen: dict(x=normal(gen, N, H), weight=normal(gen, H)),
             ("y",), lambda x, weight: F.rms_norm(x, x.shape[-1:], weight, EPS), rmsnorm),
        Case("fused_residual_add_rmsnorm", "",
             lambda gen: dict(x=normal(gen, N, H), residual=normal(gen, N, H),
                              weight=normal(gen, H)),
             ("y", "r"), residual_rms_norm, fused_residual_add_rmsnorm),
        Case("swiglu", "",
             lambda gen: dict(gate=normal(gen, N, H), up=normal(gen, N, H)),
             ("out",), lambda gate, up: F.silu(gate) * up, swiglu),
        Case("softmax", "",
             lambda gen: dict(x=normal(gen, NV, V)),
             ("y",), lambda x: torch.softmax(x, -1), softmax),
        cross_entropy("mean"),
        cross_entropy("none"),
        Case("fused_linear_cross_entropy", "",
             lambda gen: dict(x=normal(gen, M, H), weight=normal(gen, V, H, std=H ** -0.5),
                              bias=normal(gen, V), labels=draw_labels(gen, M)),
             ("loss",), linear_cross_entropy, fused_linear_cross_entropy),
        Case("gemm", "",
             lambda gen: dict(a=normal(gen, M, H), b=normal(gen, H, H)),
             ("out",), lambda a, b: a @ b, matmul(meshfuse.gemm), backward=False),
        # Attention scores q @ k^T of M tokens in H / 128 heads: a batch of short (K = 128) sums.
        Case("bmm", "",
             lambda gen: dict(a=normal(gen, heads, M, HEAD_DIM), b=normal(gen, heads, HEAD_DIM, M)),
             ("out",), lambda a, b: a @ b, matmul(meshfuse.bmm), backward=False),
        Case("linear", "",
             lambda gen: dict(x=normal(gen, M, H), weight=normal(gen, H, H, std=H ** -0.5),
                              bias=normal(gen, H)),
             ("out",), lambda x, weight, bias: F.linear(x, weight, bias), linear),
        Case("rnn", "",
             recurrent_inputs(""),
             ("output", "final_state"),
             lambda input, weight, input_state: torch_loop(rnn_step, [input], [weight],
                                                           input_state),
             rnn),
        Case("gru", "",
             recurrent_inputs("", "forget_", "reset_"),
             ("output", "final_state"), gru_loop, gru),
    ]


def convert(tensors, dtype, device="cpu"):
    """The floating-point tensors of a dict in `dtype` (rounded to nearest), the integer ones as
    they are, all on `device`."""
    return {k: v.to(device, dtype if v.is_floating_point() else v.dtype)
            for k, v in tensors.items()}


def differentiate(fn, inputs):
    """fn(**inputs)'s outputs (a tuple, detached) and a function from upstream gradients to the
    gradients of the floating-point inputs (torch.autograd.grad through fn's graph)."""
    leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    outputs = fn(**leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    wrt = [v for v in leaves.values() if v.requires_grad]
    return (tuple(o.detach() for o in outputs),
            lambda upstream: torch.autograd.grad(outputs, wrt, upstream))


def evaluate(case, seed, dtype, device):
    """[(direction, output, meshfuse's, PyTorch's, truth)] of one case in one dtype."""
    gen = torch.Generator().manual_seed(seed)
    inputs = convert(case.inputs(gen), dtype)
    # The truth on the device too: fp64 there is as exact as on the host, and a GPU's fp64 GEMMs
    # take seconds where the host's take minutes.
    truth, truth_backward = differentiate(case.reference, convert(inputs, torch.float64, device))
    # Upstream gradients in the dtype, like the inputs: 1 for a scalar loss, as in training.
    upstream = [torch.ones((), dtype=dtype) if o.dim() == 0 else normal(gen, *o.shape).to(dtype)
                for o in truth] if case.backward else []
    on_device = convert(inputs, dtype, device)
    upstream_on_device = [u.to(device) for u in upstream]
    ours, our_grads = case.meshfuse(on_device, upstream_on_device)
    theirs, their_backward = differentiate(case.reference, on_device)
    rows = [("forward", *row) for row in zip(case.outputs, ours, theirs, truth)]
    if case.backward:
        names = ["grad_" + k for k, v in inputs.items() if v.is_floating_point()]
        rows += [("backward", *row) for row in zip(
            names, our_grads, their_backward(upstream_on_device),
            truth_backward([u.double().to(device) for u in upstream]))]
    return rows


def max_rel_err(out, truth):
    """max |out - truth| / max(|truth|, 2^-10 max|truth|), in fp64 on out's device."""
    truth = truth.to(out.device)
    magnitude = truth.abs()
    floor = magnitude.max() * 2**-10
    return ((out.double() - truth).abs() / magnitude.clamp_min(floor)).max().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtypes", default="f32,bf16,f16", help="comma-separated, of f32, bf16, f16")
    p.add_argument("--ops", default="", help="comma-separated subset")
    for key, (what, cpu, cuda) in SIZES.items():
        p.add_argument("--" + key.replace("_", "-"), type=int,
                       help=f"{what} (default: cpu {cpu}, cuda {cuda})")
    p.add_argument("--loss-dtype", default="same", choices=["same", "f32"],
                   help="meshfuse's loss (and grad_loss) of cross_entropy and "
                   "fused_linear_cross_entropy: the logits' dtype, or f32")
    p.add_argument("--grad-weight-dtype", default="f32", choices=["same", "f32"],
                   help="fused_linear_cross_entropy's grad_weight and grad_bias: f32 (meshfuse."
                   "torch's default accum_dtype for 16-bit weights; the weight's own for f32), "
                   "or the weight's dtype (Liger-Kernel's way: rounded once per chunk)")
    p.add_argument("--seed", type=int, default=0,
                   help="another draw of the inputs (the error is a maximum over elements: a "
                   "ratio near 1 is within the spread between draws)")
    p.add_argument("--json", default="", help="write the records here")
    a = p.parse_args()
    for key, (_, cpu, cuda) in SIZES.items():
        if getattr(a, key) is None:
            setattr(a, key, cpu if a.device == "cpu" else cuda)
    device = torch.device(a.device)
    wanted = set(filter(None, a.ops.split(",")))
    names = {v: k for k, v in DTYPES.items()}

    where = torch.cuda.get_device_name(device) if a.device == "cuda" else "cpu"
    print(f"# numerics on {where} (torch {torch.__version__}, {torch.get_num_threads()} threads): "
          f"error = max |out - truth| / max(|truth|, 2^-10 max|truth|), truth in fp64 from the "
          f"same rounded inputs; tokens {a.tokens}, hidden {a.hidden}, vocab {a.vocab} x "
          f"{a.vocab_tokens} rows, gemm rows {a.gemm_tokens}, rnn/gru B={BATCH} S={a.seq_len} "
          f"N={HEADS} H={STATE}; loss {a.loss_dtype}, grad_weight {a.grad_weight_dtype}, "
          f"seed {a.seed}",
          flush=True)
    print(f"{'op':30} {'dir':8} {'output':18} {'dtype':5} {'device':6} {'meshfuse':>10} "
          f"{'torch':>10} {'ratio':>6}")
    records, worse_lines = [], []
    for index, case in enumerate(cases(a)):
        if wanted and case.op not in wanted:
            continue
        op = f"{case.op} ({case.variant})" if case.variant else case.op
        for dtype_name in a.dtypes.split(","):
            for direction, output, ours, theirs, truth in evaluate(
                    case, index + 1000 * a.seed, DTYPES[dtype_name], device):
                err, torch_err = max_rel_err(ours, truth), max_rel_err(theirs, truth)
                ratio = err / torch_err if torch_err else (math.inf if err else 1.0)
                worse = err > torch_err
                # meshfuse's output dtype where it is not the one under test (f32 loss, grads).
                label = output + ("" if ours.dtype == theirs.dtype else f" [{names[ours.dtype]}]")
                line = (f"{op:30} {direction:8} {label:18} {dtype_name:5} {a.device:6} {err:10.3e} "
                        f"{torch_err:10.3e} {ratio:6.2f}{'  worse' if worse else ''}")
                print(line, flush=True)
                worse_lines += [line] if worse else []
                records.append(dict(op=case.op, variant=case.variant, direction=direction,
                                    output=output, dtype=dtype_name, device=a.device,
                                    shape=list(truth.shape), meshfuse_dtype=names[ours.dtype],
                                    meshfuse_err=err, torch_err=torch_err, ratio=ratio,
                                    worse=worse, seed=a.seed))
    print(f"# meshfuse's error is above PyTorch's on {len(worse_lines)} of {len(records)} rows"
          + "".join("\n" + line for line in worse_lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
