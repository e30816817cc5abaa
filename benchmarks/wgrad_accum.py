"""Weight-gradient accumulation into the fp32 main gradient (issue 41 item 4): the wgrad GEMM
with a separate add (FP8 GEMM to bf16 or fp32, then main_grad.add_) against the GEMM that
accumulates in place (graphfp8.ops.fp8_gemm_accumulate_, cuBLASLt with beta = 1), at Llama 1B
and 8B wgrad shapes; then SwiGLU LayerNormMLP graphed fwd+bwd per microbatch with
fuse_wgrad_accumulation against the same graph plus Megatron's add of each .grad into
main_grad. 3 interleaved repeats per row, the median and the spread."""

from __future__ import annotations

import statistics

import torch

import graphfp8 as g8
from benchmarks.common import environment, print_table, time_device
from benchmarks.glu import TorchSwiGLU, _copy_weights
from benchmarks.peers import MICROBATCHES_PER_STEP, RECIPE
from graphfp8 import ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (name, N out_features, K in_features, M tokens): dw (N, K) = dy.T (N, M) @ x (M, K).
GEMMS = [
    ("1b qkv", 3072, 2048, 8192), ("1b fc1", 16384, 2048, 8192), ("1b fc2", 2048, 8192, 8192),
    ("8b qkv", 6144, 4096, 8192), ("8b fc1", 28672, 4096, 8192), ("8b fc2", 4096, 14336, 8192),
]  # fmt: skip
MLPS = [(2048, 8192, 8192), (4096, 14336, 8192)]  # (hidden, ffn, tokens): 1B and 8B
QUICK_GEMMS, QUICK_MLPS = [("quick", 32, 48, 32)], [(32, 48, 32)]
REPEATS = 3


def _fp8(rows: int, cols: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, cols, device=device)
    return x.to(dtype), torch.full((1,), 0.5, device=device)


def gemm_peers(n: int, k: int, m: int, device) -> dict:
    """{name: call}: dW's three forms on the same operands, each into its own main_grad."""
    dy_t, s_dy = _fp8(n, m, E5M2, device)  # dy's transpose (N, M), E5M2 as HYBRID's gradients
    x_t, s_x = _fp8(k, m, E4M3, device)  # x's transpose (K, M)
    grads = [torch.zeros(n, k, device=device) for _ in range(3)]

    def add(out_dtype, g):
        return lambda: g.add_(ops.fp8_gemm(dy_t, s_dy, x_t.t(), s_x, out_dtype))

    return {
        "bf16 wgrad + add": add(torch.bfloat16, grads[0]),
        "fp32 wgrad + add": add(torch.float32, grads[1]),
        "fused (beta = 1)": lambda: ops.fp8_gemm_accumulate_(dy_t, s_dy, x_t.t(), s_x, grads[2]),
    }


def mlp_peers(hidden: int, ffn: int, tokens: int, device) -> dict:
    """{name: step(i)}: SwiGLU LayerNormMLP graphed (make_graphed_callables), bf16 weights with
    fp32 main gradients; unfused adds each .grad into main_grad after the backward."""
    torch.manual_seed(0)
    ref = TorchSwiGLU(hidden, ffn, device)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)

    def build(fused: bool):
        m = g8.LayerNormMLP(hidden, ffn, normalization="RMSNorm", bias=False,
                            activation="swiglu", params_dtype=torch.bfloat16, device=device,
                            fuse_wgrad_accumulation=fused)  # fmt: skip
        _copy_weights(m, ref)
        weights = [m.fc1_weight, m.fc2_weight]
        for w in weights:
            w.main_grad = torch.zeros(w.shape, device=device)
        graphed = g8.make_graphed_callables(m, (x,), fp8_enabled=True, fp8_recipe=RECIPE,
                                            fp8_weight_caching=True)  # fmt: skip

        def step(i):
            graphed(x, is_first_microbatch=i % MICROBATCHES_PER_STEP == 0).backward(dy)
            if not fused:  # Megatron's hook: .grad into main_grad, .grad dropped
                for w in weights:
                    w.main_grad.add_(w.grad)
                    w.grad = None

        return step

    return {"graphed + add": lambda: build(False), "graphed fused": lambda: build(True)}


def _interleaved(calls: dict, device, iters: int, repeats: int) -> dict:
    """{name: [ms per repeat]}, the peers timed in turn within each repeat."""
    out = {name: [] for name in calls}
    for _ in range(REPEATS):
        for name, fn in calls.items():
            out[name].append(time_device(fn, device, warmup=2, iters=iters, repeats=repeats))
    return out


def _summary(samples: list[float]) -> dict:
    med = statistics.median(samples)
    return {"ms": med, "spread": (max(samples) - min(samples)) / med, "repeats": samples}


def run(device, quick: bool = False) -> dict:
    gemms, mlps = (QUICK_GEMMS, QUICK_MLPS) if quick else (GEMMS, MLPS)
    iters, repeats = (1, 1) if quick else (20, 3)
    gemm_rows = []
    for name, n, k, m in gemms:
        times = _interleaved(gemm_peers(n, k, m, device), device, iters, repeats)
        gemm_rows.append({"gemm": name, "N": n, "K": k, "M": m,
                          **{p: _summary(t) for p, t in times.items()}})  # fmt: skip
        del times
    peers = ["bf16 wgrad + add", "fp32 wgrad + add", "fused (beta = 1)"]
    print_table(
        f"wgrad into main_grad, ms (spread over {REPEATS} repeats), {device}",
        ["gemm (N, K, M)", *peers, "fused / bf16+add"],
        [[f"{r['gemm']} ({r['N']}, {r['K']}, {r['M']})",
          *[f"{r[p]['ms']:.4g} ({r[p]['spread']:.1%})" for p in peers],
          f"{r['fused (beta = 1)']['ms'] / r['bf16 wgrad + add']['ms']:.3f}"] for r in gemm_rows],
    )  # fmt: skip
    mlp_rows = []
    for hidden, ffn, tokens in mlps:
        steps = {name: build() for name, build in mlp_peers(hidden, ffn, tokens, device).items()}
        counters = {name: iter(range(10**9)) for name in steps}
        calls = {name: (lambda s=s, c=counters[name]: s(next(c))) for name, s in steps.items()}
        times = _interleaved(calls, device, max(iters // 2, 1), repeats)
        mlp_rows.append({"hidden": hidden, "ffn": ffn, "tokens": tokens,
                         **{p: _summary(t) for p, t in times.items()}})  # fmt: skip
        del steps, calls
    print_table(
        f"SwiGLU LayerNormMLP graphed fwd+bwd + main_grad, ms per microbatch, {device}",
        ["h, F, T", "graphed + add", "graphed fused", "fused / +add"],
        [[f"{r['hidden']}, {r['ffn']}, {r['tokens']}",
          *[f"{r[p]['ms']:.4g} ({r[p]['spread']:.1%})" for p in ("graphed + add", "graphed fused")],
          f"{r['graphed fused']['ms'] / r['graphed + add']['ms']:.3f}"] for r in mlp_rows],
    )  # fmt: skip
    return {"env": environment(device), "gemms": gemm_rows, "mlps": mlp_rows}
