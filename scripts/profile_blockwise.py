"""Per-kernel GPU time of the Llama SwiGLU MLP block (benchmarks/blockwise_te.py's peers) under
graphfp8 delayed scaling, graphfp8 blockwise (fused quantizers, weight cache; then again with
GRAPHFP8_BLOCKWISE_GLU_KERNEL on: the norm and SwiGLU as graphfp8 bf16 kernels,
modules/_blockwise_plain.py) and, when TE imports, TE's Float8BlockScaling graphed: where
blockwise's extra time goes (issue 42's speed row).

    python scripts/profile_blockwise.py [--shapes 1b,8b] --json out.json

--shapes: comma-separated MLP shapes, each a name of SHAPES (1b: Llama-3.2-1B, h 2048, F 8192,
4096 tokens, the default; 8b: Llama-3-8B, h 4096, F 14336, 8192 tokens) or HIDDENxFFNxTOKENS.

Prints per peer the kernels sorted by GPU time (launches and microseconds per microbatch) and
the totals; times come from torch.profiler (benchmarks/kernel_times.py). First, the blockwise
quantize kernel alone at the MLP's operand shapes against a bf16 copy timed in the same run
(benchmarks/variants.py's block_quantize_rows; issue 42 asks >= 0.6 of copy).
"""

from __future__ import annotations

import argparse
import json

import torch

import graphfp8 as g8
from benchmarks.blockwise_te import _g8_peer, _te_peers, g8_plain_peer
from benchmarks.glu import TorchSwiGLU
from benchmarks.kernel_times import kernel_stats
from benchmarks.variants import block_quantize_rows, block_quantize_table
from graphfp8.ops.blockwise_fused import blockwise_kernels

SHAPES = {"1b": (2048, 8192, 4096), "8b": (4096, 14336, 8192)}


def _shape(spec: str) -> tuple[int, int, int]:
    """(hidden, ffn, tokens) of a SHAPES name or HIDDENxFFNxTOKENS."""
    if spec in SHAPES:
        return SHAPES[spec]
    parts = spec.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise SystemExit(f"--shapes: {spec!r} is neither one of {sorted(SHAPES)} nor HxFxT")
    return tuple(int(p) for p in parts)


def _peers(hidden: int, ffn: int, tokens: int) -> dict:
    torch.manual_seed(0)
    ref = TorchSwiGLU(hidden, ffn, "cuda")
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    te = _te_peers(ref, x, dy)
    return {
        "graphfp8 delayed": lambda: _g8_peer(ref, x, dy, g8.DelayedScaling()),
        "graphfp8 blockwise": lambda: g8_plain_peer(ref, x, dy, g8.Float8BlockScaling(), on=False),
        "graphfp8 blockwise+glu": lambda: g8_plain_peer(ref, x, dy, g8.Float8BlockScaling()),
        **{k: v for k, v in te.items() if "graphed" in k},
    }


def _profile(hidden: int, ffn: int, tokens: int, iters: int) -> dict:
    """{peer: {kernel: {launches, us}} or the error text of a peer that does not build}."""
    out = {}
    print(f"## MLP h {hidden} ffn {ffn} tokens {tokens}")
    with blockwise_kernels("fused"):
        for name, build in _peers(hidden, ffn, tokens).items():
            try:
                step = build()
                counter = iter(range(10**9))
                stats = kernel_stats(lambda s=step, c=counter: s(next(c)), iters=iters)
            except Exception as exc:  # a peer this GPU or TE refuses is a row of the table
                out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(f"## {name}: {out[name]}")
                continue
            rows = sorted(stats.items(), key=lambda kv: -kv[1][1])
            out[name] = {k: {"launches": n, "us": us} for k, (n, us) in rows}
            total = sum(us for _, us in stats.values())
            print(f"## {name}: {total:.1f} us of kernels per microbatch, {len(rows)} kernels")
            for k, (n, us) in rows[:25]:
                print(f"  {us:9.1f} us  {n:5.1f}x  {k[:110]}")
            g8.reset_state()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1b", help="comma-separated: 1b, 8b or HxFxT")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="write the tables here too")
    args = p.parse_args(argv)
    shapes = [_shape(s) for s in args.shapes.split(",")]
    quantize = block_quantize_rows("cuda")
    block_quantize_table(quantize, "cuda")
    for r in quantize:
        print(f"## block_quantize {r['shape']}: {r['us']:.1f} us, {r['ratio_to_copy']:.3f} of copy")
        print(
            f"## block_quantize staged {r['shape']}: {r['staged_us']:.1f} us, "
            f"{r['staged_ratio_to_copy']:.3f} of copy"
        )
    out = {"x".join(map(str, s)): _profile(*s, args.iters) for s in shapes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "block_quantize": quantize, "kernels": out}, f,
                      indent=1)  # fmt: skip
    return out


if __name__ == "__main__":
    main()
