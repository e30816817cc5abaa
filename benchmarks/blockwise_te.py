"""Blockwise FP8 against TransformerEngine's Float8BlockScaling (issue 42's speed peer): the Llama
SwiGLU MLP block (RMSNorm -> fc1 (h, 2F) -> silu(g) * u -> fc2 (F, h), no biases) forward +
backward per microbatch on the same weights and inputs, every peer in one process: graphfp8
delayed and blockwise FP8 graphed (the fused quantize kernels, the weight cache; blockwise again
with GRAPHFP8_BLOCKWISE_GLU_KERNEL on: "graphfp8 blockwise+glu graphed"), TE
Float8BlockScaling eager and graphed, TE DelayedScaling graphed, when `import
transformer_engine.pytorch` works (benchmarks/te_peers.py; TE is never a dependency). The MLP,
not the TransformerLayer: TE's fused attention does not load on the GPU machine
(te_peers.TE_UNFUSED), so a layer row would compare attention implementations.

scripts/bench_blockwise.py prints these rows after its TransformerLayer rows; times in ms per
microbatch, ratios against graphfp8 blockwise graphed.
"""

from __future__ import annotations

import torch

import graphfp8 as g8
from benchmarks import te_peers
from benchmarks.common import time_device
from benchmarks.glu import TorchSwiGLU, _copy_weights, te_mlp_like
from benchmarks.peers import MICROBATCHES_PER_STEP
from graphfp8.modules._blockwise_plain import PLAIN
from graphfp8.ops.blockwise_fused import blockwise_kernels

__all__ = ["g8_plain_peer", "mlp_rows", "te_block_recipe"]


def te_block_recipe():
    """TE's Float8BlockScaling with its defaults (E4M3, 1x128 / 128x128 / 1x128, power-of-2
    scales: graphfp8.Float8BlockScaling()'s twin)."""
    from transformer_engine.common import recipe

    return recipe.Float8BlockScaling()


def _g8_peer(ref, x, dy, recipe):
    hidden, ffn = ref.fc2.weight.shape
    m = g8.LayerNormMLP(hidden, ffn, normalization="RMSNorm", bias=False, activation="swiglu",
                        params_dtype=torch.bfloat16, device=x.device)  # fmt: skip
    _copy_weights(m, ref)
    graphed = g8.make_graphed_callables(m, (x,), fp8_enabled=True, fp8_recipe=recipe,
                                        fp8_weight_caching=True)  # fmt: skip
    return lambda i: graphed(x, is_first_microbatch=i % MICROBATCHES_PER_STEP == 0).backward(dy)


def g8_plain_peer(ref, x, dy, recipe, on: bool = True):
    """_g8_peer captured with GRAPHFP8_BLOCKWISE_GLU_KERNEL on (the graphs keep its kernels):
    the norm and the SwiGLU as graphfp8 bf16 kernels (graphfp8/modules/_blockwise_plain.py);
    with on=False, torch's norm and activation ops (the switch's default before session 10)."""
    before, PLAIN.on = PLAIN.on, on
    try:
        return _g8_peer(ref, x, dy, recipe)
    finally:
        PLAIN.on = before


def _te_peers(ref, x, dy) -> dict:
    """{name: build()} of the TE peers, {} without TE."""
    te_pt = te_peers.te()
    if te_pt is None or x.device.type != "cuda":
        return {}

    def build():
        return te_mlp_like(te_pt, ref)

    def graphed(recipe):
        g = te_peers.same_stream_graphed(build(), (x,), fp8_enabled=True, fp8_recipe=recipe,
                                         fp8_weight_caching=True)  # fmt: skip
        return te_peers.te_step(g, x, dy, recipe, MICROBATCHES_PER_STEP)

    def eager(recipe):
        return te_peers.te_step(build(), x, dy, recipe, MICROBATCHES_PER_STEP)

    return {
        "TE blockwise eager": lambda: eager(te_block_recipe()),
        "TE blockwise graphed": lambda: graphed(te_block_recipe()),
        "TE delayed graphed": lambda: graphed(te_peers.te_recipe()),
    }


def mlp_rows(hidden: int, ffn: int, tokens: int, device, iters: int = 20, repeats: int = 3,
             kernels: str = "fused") -> dict:  # fmt: skip
    """{peer: ms per microbatch, or the error text of a peer that does not build or run};
    graphfp8's blockwise quantizers as GRAPHFP8_BLOCKWISE_KERNELS=`kernels` says."""
    with blockwise_kernels(kernels):
        return _timed_rows(hidden, ffn, tokens, device, iters, repeats)


def _timed_rows(hidden: int, ffn: int, tokens: int, device, iters: int, repeats: int) -> dict:
    torch.manual_seed(0)
    ref = TorchSwiGLU(hidden, ffn, device)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    peers = {
        "graphfp8 delayed graphed": lambda: _g8_peer(ref, x, dy, g8.DelayedScaling()),
        "graphfp8 blockwise graphed": lambda: g8_plain_peer(
            ref, x, dy, g8.Float8BlockScaling(), on=False
        ),
        "graphfp8 blockwise+glu graphed": lambda: g8_plain_peer(
            ref, x, dy, g8.Float8BlockScaling()
        ),
        **_te_peers(ref, x, dy),
    }
    rows = {}
    for name, build in peers.items():
        try:
            step = build()
            counter = iter(range(10**9))
            rows[name] = time_device(lambda s=step, c=counter: s(next(c)), device, warmup=3,
                                     iters=iters, repeats=repeats)  # fmt: skip
        except Exception as exc:  # a peer this GPU or TE refuses is a row of the table
            rows[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
        g8.reset_state()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows


def print_mlp(rows: dict, hidden: int, ffn: int, tokens: int) -> None:
    """The rows as tokens/s, with each against graphfp8 blockwise graphed."""
    base = rows.get("graphfp8 blockwise graphed")
    print(f"SwiGLU MLP h {hidden} ffn {ffn} tokens {tokens} (fwd + bwd per microbatch; TE is "
          "the same block, no attention)")  # fmt: skip
    for name, ms in rows.items():
        if not isinstance(ms, float):
            print(f"  {name:28s} {ms}")
            continue
        ratio = f"   graphfp8 blockwise is {ms / base:.3f}x this" if isinstance(base, float) else ""
        print(f"  {name:28s} {tokens / ms * 1e3:12.0f} tokens/s{ratio}")
