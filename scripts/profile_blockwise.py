"""Per-kernel GPU time of the Llama SwiGLU MLP block (benchmarks/blockwise_te.py's peers) under
graphfp8 delayed scaling, graphfp8 blockwise (fused quantizers, weight cache) and, when TE
imports, TE's Float8BlockScaling graphed: where blockwise's extra time goes (issue 42's speed row).

    python scripts/profile_blockwise.py [--hidden 2048 --ffn 8192 --tokens 4096] --json out.json

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
from benchmarks.blockwise_te import _g8_peer, _te_peers
from benchmarks.glu import TorchSwiGLU
from benchmarks.kernel_times import kernel_stats
from benchmarks.variants import block_quantize_rows, block_quantize_table
from graphfp8.ops.blockwise_fused import blockwise_kernels


def _peers(hidden: int, ffn: int, tokens: int) -> dict:
    torch.manual_seed(0)
    ref = TorchSwiGLU(hidden, ffn, "cuda")
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    te = _te_peers(ref, x, dy)
    return {
        "graphfp8 delayed": lambda: _g8_peer(ref, x, dy, g8.DelayedScaling()),
        "graphfp8 blockwise": lambda: _g8_peer(ref, x, dy, g8.Float8BlockScaling()),
        **{k: v for k, v in te.items() if "graphed" in k},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="write the tables here too")
    args = p.parse_args(argv)
    out = {}
    quantize = block_quantize_rows("cuda")
    block_quantize_table(quantize, "cuda")
    for r in quantize:
        print(f"## block_quantize {r['shape']}: {r['us']:.1f} us, {r['ratio_to_copy']:.3f} of copy")
        print(
            f"## block_quantize staged {r['shape']}: {r['staged_us']:.1f} us, "
            f"{r['staged_ratio_to_copy']:.3f} of copy"
        )
    with blockwise_kernels("fused"):
        for name, build in _peers(args.hidden, args.ffn, args.tokens).items():
            try:
                step = build()
                counter = iter(range(10**9))
                stats = kernel_stats(lambda s=step, c=counter: s(next(c)), iters=args.iters)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "block_quantize": quantize, "kernels": out}, f,
                      indent=1)  # fmt: skip
    return out


if __name__ == "__main__":
    main()
