"""SwiGLU benchmark (issue 23): the Llama MLP block RMSNorm -> fc1 (h, 2F) -> silu(g) * u -> fc2
(F, h), no biases, forward + backward per microbatch, every peer in one process: bf16 torch
(eager, torch.cuda graphs), graphfp8 FP8 graphed with the fused GLU kernels and with the
torch-ops fallback (graphfp8.ops.glu), and TransformerEngine's LayerNormMLP(activation="swiglu")
FP8 eager and graphed when `import transformer_engine.pytorch` works. Then the GLU kernels against
the copy rate and the fallback they replace. Targets: FP8 graphed >= 1.4x bf16 graphed, not
slower than TE."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

import graphfp8 as g8
from benchmarks import te_peers
from benchmarks.common import environment, print_table, time_device
from benchmarks.kernels import _rotating, _timed
from benchmarks.peers import MICROBATCHES_PER_STEP, RECIPE
from graphfp8 import ops
from graphfp8.ops import glu as glu_ops

# (hidden, ffn, tokens): Llama's 8/3 h MLP widths (rounded as Llama rounds them).
SHAPES = [(2048, 5632, 4096), (4096, 11008, 8192)]
QUICK = [(32, 48, 32)]


class TorchSwiGLU(nn.Module):
    """RMSNorm(h) -> Linear(h, 2F) -> silu(g) * u -> Linear(F, h), no biases, plain torch."""

    def __init__(self, hidden: int, ffn: int, device):
        super().__init__()
        kw = dict(dtype=torch.bfloat16, device=device)
        self.norm = nn.RMSNorm(hidden, eps=1e-5, **kw)
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False, **kw)
        self.fc2 = nn.Linear(ffn, hidden, bias=False, **kw)

    def forward(self, x):
        g, u = self.fc1(self.norm(x)).chunk(2, dim=-1)
        return self.fc2(F.silu(g) * u)


def _copy_weights(dst: nn.Module, ref: TorchSwiGLU) -> nn.Module:
    """Loads ref's weights into a LayerNormMLP-named module (graphfp8's or TE's): the same
    parameter names and the same gate-first fc1 layout."""
    with torch.no_grad():
        dst.layer_norm_weight.copy_(ref.norm.weight)
        dst.fc1_weight.copy_(ref.fc1.weight)
        dst.fc2_weight.copy_(ref.fc2.weight)
    return dst


def te_mlp_like(te_pt, ref: TorchSwiGLU) -> nn.Module:
    """TransformerEngine's LayerNormMLP (RMSNorm, SwiGLU, no bias, bf16 on the GPU) holding
    `ref`'s weights: the TE peer of the GLU and blockwise benchmarks."""
    hidden, ffn = ref.fc2.weight.shape
    m = te_pt.LayerNormMLP(hidden, ffn, bias=False, normalization="RMSNorm", activation="swiglu",
                           params_dtype=torch.bfloat16, device="cuda")  # fmt: skip
    return _copy_weights(m, ref)


@contextlib.contextmanager
def _glu_kernels(on: bool):
    """The fused GLU CUDA kernels on or off while a peer is built (its graphs keep the choice)."""
    saved = glu_ops.CUDA_KERNELS
    glu_ops.CUDA_KERNELS = on
    try:
        yield
    finally:
        glu_ops.CUDA_KERNELS = saved


def _g8_peer(ref, x, dy, fused: bool):
    hidden, ffn = ref.fc2.weight.shape
    m = g8.LayerNormMLP(hidden, ffn, normalization="RMSNorm", bias=False, activation="swiglu",
                        params_dtype=torch.bfloat16, device=x.device)  # fmt: skip
    _copy_weights(m, ref)
    with _glu_kernels(fused):
        graphed = g8.make_graphed_callables(m, (x,), fp8_enabled=True, fp8_recipe=RECIPE,
                                            fp8_weight_caching=True)  # fmt: skip
    return lambda i: graphed(x, is_first_microbatch=i % MICROBATCHES_PER_STEP == 0).backward(dy)


def _te_peers(ref, x, dy) -> dict:
    """TransformerEngine's SwiGLU LayerNormMLP, FP8 eager and graphed (benchmarks/te_peers.py: TE's
    recipe, its one-stream capture, its step), or {} without TE."""
    te_pt = te_peers.te()
    if te_pt is None:
        return {}
    recipe = te_peers.te_recipe()

    def build():
        return te_mlp_like(te_pt, ref)

    def graphed():
        g = te_peers.same_stream_graphed(build(), (x,), fp8_enabled=True, fp8_recipe=recipe,
                                         fp8_weight_caching=True)  # fmt: skip
        return te_peers.te_step(g, x, dy, recipe, MICROBATCHES_PER_STEP)

    return {
        "TE fp8 eager": lambda: te_peers.te_step(build(), x, dy, recipe, MICROBATCHES_PER_STEP),
        "TE fp8 graphed": graphed,
    }


def make_peers(hidden: int, ffn: int, tokens: int, device) -> dict:
    """{name: build() -> step(i)}, every peer on the same weights and inputs."""
    torch.manual_seed(0)
    ref = TorchSwiGLU(hidden, ffn, device)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)

    def bf16_eager():
        m = copy.deepcopy(ref)
        return lambda i: m(x).backward(dy)

    peers = {"bf16 eager": bf16_eager}
    if torch.device(device).type == "cuda":

        def bf16_graphed():
            m = torch.cuda.make_graphed_callables(copy.deepcopy(ref), (x,))
            return lambda i: m(x).backward(dy)

        peers["bf16 graphed"] = bf16_graphed
    peers["graphfp8 fp8 graphed (fused GLU)"] = lambda: _g8_peer(ref, x, dy, True)
    peers["graphfp8 fp8 graphed (fallback)"] = lambda: _g8_peer(ref, x, dy, False)
    if torch.device(device).type == "cuda":
        peers.update(_te_peers(ref, x, dy))
    return peers


def bench_shape(hidden: int, ffn: int, tokens: int, device, iters: int, repeats: int) -> dict:
    rows = {}
    for name, build in make_peers(hidden, ffn, tokens, device).items():
        try:
            step = build()
        except Exception as exc:  # a TE peer that does not build here: say so, keep going
            if not name.startswith("TE"):
                raise
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
            continue
        counter = iter(range(10**9))
        rows[name] = time_device(lambda s=step, c=counter: s(next(c)), device, warmup=3,
                                 iters=iters, repeats=repeats)  # fmt: skip
        del step
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return {"hidden": hidden, "ffn": ffn, "tokens": tokens, "ms": rows}


def kernel_rows(device, tokens: int, ffn: int) -> list[dict]:
    """glu_cast_transpose and dglu_cast_transpose_dbias (no dbias) at (tokens, F) against the
    fallback (torch ops + cast_transpose) and a bf16 copy of h."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    nbytes = 8 * tokens * ffn  # the backward: h and da read (6 B), dh's FP8 layouts (4 B) / 2F
    sets = _rotating(lambda: (torch.randn(tokens, 2 * ffn, device=device, dtype=torch.bfloat16),
                              torch.randn(tokens, ffn, device=device, dtype=torch.bfloat16)),
                     nbytes, device)  # fmt: skip
    one, amax = torch.ones(1, device=device), torch.zeros(1, device=device)
    cases = {  # name: (bytes moved, fused, fallback)
        "glu_cast_transpose": (
            6 * tokens * ffn,
            lambda h, da: ops.glu_cast_transpose(h, "swiglu", one, amax, e4m3),
            lambda h, da: ops.cast_transpose(glu_ops.glu(h, "swiglu"), one, amax, e4m3)),
        "dglu_cast_transpose": (
            10 * tokens * ffn,
            lambda h, da: ops.dglu_cast_transpose_dbias(da, h, "swiglu", one, amax, e5m2,
                                                        dbias=False),
            lambda h, da: ops.cast_transpose(glu_ops.dglu(da, h, "swiglu"), one, amax, e5m2)),
    }  # fmt: skip
    copy_ms = _timed(lambda i: sets[i][0].clone(), len(sets), device)
    copy_gbs = 8 * tokens * ffn / copy_ms / 1e6
    rows = []
    for name, (moved, fused, fallback) in cases.items():
        ms = _timed(lambda i, f=fused: f(*sets[i]), len(sets), device)
        ms_fallback = _timed(lambda i, f=fallback: f(*sets[i]), len(sets), device)
        gbs = moved / ms / 1e6
        rows.append(dict(op=name, shape=f"{tokens}x{ffn}", fused_ms=ms, fallback_ms=ms_fallback,
                         GBps=gbs, ratio_to_copy=gbs / copy_gbs,
                         speedup=ms_fallback / ms))  # fmt: skip
    return rows


def run(device, quick: bool = False) -> dict:
    shapes, iters, repeats = (QUICK, 1, 1) if quick else (SHAPES, 10, 3)
    results = [bench_shape(h, f, t, device, iters, repeats) for h, f, t in shapes]
    kernels = [row for _, f, t in shapes for row in kernel_rows(device, t, f)]
    names = list(results[0]["ms"])
    text = print_table(
        f"SwiGLU LayerNormMLP (RMSNorm, no biases) fwd+bwd, ms per microbatch, {device}",
        ["h, F, T", *names],
        [[f"{r['hidden']}, {r['ffn']}, {r['tokens']}", *[r["ms"].get(n, "-") for n in names]]
         for r in results],
    )  # fmt: skip
    ours = "graphfp8 fp8 graphed (fused GLU)"
    peers = [n for n in ("bf16 graphed", "bf16 eager", "TE fp8 graphed") if n in names]
    text += print_table(
        "graphfp8 FP8 graphed (fused GLU) speed-up over each peer (peer ms / ours; > 1 is faster)",
        ["h, F, T", *peers, "fallback"],
        [[f"{r['hidden']}, {r['ffn']}, {r['tokens']}",
          *[r["ms"][p] / r["ms"][ours] if p in r["ms"] else "-" for p in peers],
          r["ms"]["graphfp8 fp8 graphed (fallback)"] / r["ms"][ours]] for r in results],
    )  # fmt: skip
    text += print_table(
        "GLU kernels vs the torch-ops fallback and a bf16 copy",
        ["op", "T x F", "fused ms", "fallback ms", "GB/s", "/ copy", "speed-up"],
        [[k["op"], k["shape"], k["fused_ms"], k["fallback_ms"], k["GBps"], k["ratio_to_copy"],
          k["speedup"]] for k in kernels],
    )  # fmt: skip
    return {"env": environment(device), "shapes": results, "kernels": kernels, "table": text}
