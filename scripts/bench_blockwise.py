"""Blockwise FP8 against delayed scaling and bf16 on one Llama-3.2-1B block (hidden 2048, 32
heads, 8 key/value heads, SwiGLU 8192, RMSNorm; seq 4096), graphed forward + backward, every
row in one process: tokens/s (median of --repeats, with their spread) and the ratio to delayed
scaling (docs/fp8.md, "Blockwise scaling"). On the H200:

    GRAPHFP8_BLOCKWISE_GEMM=scaled_mm python scripts/bench_blockwise.py [--seq 4096 --batch 1]

The rows: bf16; delayed scaling; blockwise with the torch-op quantizers and the weights
quantized every microbatch (the path before the fused kernels); blockwise with the fused
quantize kernels (graphfp8/ops/blockwise_fused.py, GRAPHFP8_BLOCKWISE_KERNELS=fused), without
and with the weight cache; that last again with GRAPHFP8_BLOCKWISE_GLU_KERNEL on
(blockwise-glu-kernel: the norm and the SwiGLU forward / backward as graphfp8 kernels in bf16,
modules/_blockwise_plain.py; the other rows take the switch as the environment sets it). Rows
with the cache (delayed's too) run --microbatches per step, is_first_microbatch True on the
first (fp8_weight_caching=True). GRAPHFP8_BLOCKWISE_GEMM=emulate times the float32 emulation
instead of cuBLAS's GEMM. --device cpu runs the same rows (a smoke run: CPU times say nothing
about the GPU). Then the same block's SwiGLU MLP against
TransformerEngine's Float8BlockScaling when TE imports (benchmarks/blockwise_te.py; --no-mlp
skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import graphfp8 as g8
from benchmarks.blockwise_te import mlp_rows, print_mlp
from graphfp8.modules._blockwise_plain import PLAIN
from graphfp8.ops.blockwise_fused import blockwise_kernels

# name: (recipe, GRAPHFP8_BLOCKWISE_KERNELS, weight cache, GRAPHFP8_BLOCKWISE_GLU_KERNEL: True
# on, None as the environment sets it)
ROWS = {
    "bf16": (None, "", False, None),
    "delayed": (g8.DelayedScaling(), "", True, None),
    "blockwise-torch": (g8.Float8BlockScaling(), "torch", False, False),
    "blockwise-fused": (g8.Float8BlockScaling(), "fused", False, False),
    "blockwise-fused-cache": (g8.Float8BlockScaling(), "fused", True, False),
    "blockwise-glu-kernel": (g8.Float8BlockScaling(), "fused", True, True),
}


def _layer(args) -> torch.nn.Module:
    return g8.TransformerLayer(args.hidden, args.heads, args.ffn, num_gqa_groups=args.kv_heads,
                               max_seq_len=args.seq, normalization="RMSNorm", bias=False,
                               activation="swiglu", params_dtype=torch.bfloat16,
                               device=args.device)  # fmt: skip


def _elapsed_ms(args, run) -> float:
    """Milliseconds of run(), CUDA events on the GPU, the host clock on the CPU."""
    if args.device == "cpu":
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def tokens_per_s(args, recipe, caching: bool) -> list[float]:
    """One graphed layer's forward + backward per microbatch, timed over args.iters steps of
    args.microbatches microbatches, args.repeats times."""
    torch.manual_seed(0)
    layer = _layer(args)
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=torch.bfloat16, device=args.device,
                    requires_grad=True)  # fmt: skip
    graphed = g8.make_graphed_callables(layer, (x,), fp8_enabled=recipe is not None,
                                        fp8_recipe=recipe,
                                        fp8_weight_caching=caching)  # fmt: skip
    dy = torch.randn_like(x)

    def steps(n):
        for _ in range(n):
            for mb in range(args.microbatches):
                first = mb == 0 if caching and recipe is not None else None
                graphed(x, is_first_microbatch=first).backward(dy)

    steps(2)
    tokens = args.iters * args.microbatches * args.batch * args.seq
    return [tokens / _elapsed_ms(args, lambda: steps(args.iters)) * 1e3
            for _ in range(args.repeats)]  # fmt: skip


def _row(args, name: str):
    recipe, kernels, caching, plain = ROWS[name]
    before = PLAIN.on
    try:
        PLAIN.on = before if plain is None else plain
        with blockwise_kernels(kernels):
            return tokens_per_s(args, recipe, caching)
    except Exception as exc:  # a row the GPU refuses is a row of the table
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        PLAIN.on = before
        g8.reset_state()
        if args.device != "cpu":
            torch.cuda.empty_cache()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 2048), ("heads", 32), ("kv-heads", 8), ("ffn", 8192),
                          ("seq", 4096), ("batch", 1), ("iters", 10), ("microbatches", 4),
                          ("repeats", 3)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--no-mlp", action="store_true", help="skip the MLP rows against TE")
    args = p.parse_args(argv)
    rows = {name: _row(args, name) for name in args.rows.split(",")}
    base = rows.get("delayed")
    base = statistics.median(base) if isinstance(base, list) else None
    print(f"Llama block h {args.hidden} ffn {args.ffn} seq {args.seq} batch {args.batch}, "
          f"{args.microbatches} microbatches a step, {args.repeats} repeats, "
          f"GRAPHFP8_BLOCKWISE_GEMM={os.environ.get('GRAPHFP8_BLOCKWISE_GEMM', '')!r}")  # fmt: skip
    for name, value in rows.items():
        if not isinstance(value, list):
            print(f"  {name:22s} {value}")
            continue
        med = statistics.median(value)
        spread = (max(value) - min(value)) / med
        ratio = f"   {med / base:.3f}x delayed" if base else ""
        print(f"  {name:22s} {med:12.0f} tokens/s (spread {spread:.1%}){ratio}")
    mlp = {}
    if not args.no_mlp:
        tokens = args.batch * args.seq
        mlp = mlp_rows(args.hidden, args.ffn, tokens, args.device, args.iters, args.repeats)
        print_mlp(mlp, args.hidden, args.ffn, tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": rows, "mlp_ms": mlp}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
