"""Blockwise FP8 against delayed scaling and bf16 on one Llama-3.2-1B block (hidden 2048, 32
heads, 8 key/value heads, SwiGLU 8192, RMSNorm; seq 4096), graphed forward + backward, every
recipe in one process: tokens/s and the ratio to delayed scaling (docs/fp8.md, "Blockwise
scaling"). On the H200:

    GRAPHFP8_BLOCKWISE_GEMM=scaled_mm python scripts/bench_blockwise.py [--seq 4096 --batch 1]

Then the same block's SwiGLU MLP against TransformerEngine's Float8BlockScaling when TE imports
(benchmarks/blockwise_te.py; --no-mlp skips it). The blockwise quantizers are pure-torch
(several launches per operand), so these rows measure them too; GRAPHFP8_BLOCKWISE_GEMM=emulate
times the float32 emulation instead of cuBLAS's GEMM.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import graphfp8 as g8
from benchmarks.blockwise_te import mlp_rows, print_mlp

RECIPES = {
    "bf16": None,
    "delayed": g8.DelayedScaling(),
    "blockwise": g8.Float8BlockScaling(),
}


def _layer(args) -> torch.nn.Module:
    return g8.TransformerLayer(args.hidden, args.heads, args.ffn, num_gqa_groups=args.kv_heads,
                               max_seq_len=args.seq, normalization="RMSNorm", bias=False,
                               activation="swiglu", params_dtype=torch.bfloat16,
                               device="cuda")  # fmt: skip


def tokens_per_s(args, recipe) -> float:
    """One graphed layer's forward + backward per microbatch, CUDA events over args.iters."""
    torch.manual_seed(0)
    layer = _layer(args)
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=torch.bfloat16, device="cuda",
                    requires_grad=True)  # fmt: skip
    graphed = g8.make_graphed_callables(layer, (x,), fp8_enabled=recipe is not None,
                                        fp8_recipe=recipe)  # fmt: skip
    dy = torch.randn_like(x)

    def microbatch():
        graphed(x).backward(dy)

    for _ in range(3):
        microbatch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.iters):
        microbatch()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / args.iters
    return args.batch * args.seq / ms * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 2048), ("heads", 32), ("kv-heads", 8), ("ffn", 8192),
                          ("seq", 4096), ("batch", 1), ("iters", 20)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--no-mlp", action="store_true", help="skip the MLP rows against TE")
    args = p.parse_args()
    rows = {}
    for name, recipe in RECIPES.items():
        try:
            rows[name] = tokens_per_s(args, recipe)
        except Exception as exc:  # a recipe the GPU refuses is a row of the table
            rows[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        g8.reset_state()
        torch.cuda.empty_cache()
    base = rows["delayed"]
    print(f"Llama block h {args.hidden} ffn {args.ffn} seq {args.seq} batch {args.batch}, "
          f"GRAPHFP8_BLOCKWISE_GEMM={os.environ.get('GRAPHFP8_BLOCKWISE_GEMM', '')!r}")  # fmt: skip
    for name, value in rows.items():
        ratio = value / base if isinstance(value, float) and isinstance(base, float) else None
        text = f"{value:12.0f} tokens/s" if isinstance(value, float) else value
        print(f"  {name:10s} {text}" + (f"   {ratio:.3f}x delayed" if ratio else ""))
    mlp = {}
    if not args.no_mlp:
        tokens = args.batch * args.seq
        mlp = mlp_rows(args.hidden, args.ffn, tokens, "cuda", args.iters)
        print_mlp(mlp, args.hidden, args.ffn, tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": rows, "mlp_ms": mlp}, f, indent=1)


if __name__ == "__main__":
    main()
