"""TransformerLayer-stack benchmark: 4 graphfp8 TransformerLayers (batch 4 x seq 2048, heads =
hidden / 128, ffn = 4 x hidden), forward + backward per microbatch, FP8 + graphs against bf16 +
graphs: the same layers and the same capturer, FP8 on and off, in one process. Prints ms per
microbatch, kernels per microbatch and the FP8 speed-up (bf16 ms / FP8 ms); where
TransformerEngine imports, a graphed stack of TE TransformerLayers beside them (te_peers.py:
TE runs its unfused attention there and no RoPE, which the column names say)."""

from __future__ import annotations

import torch
from torch import nn

import graphfp8 as g8
from benchmarks.common import environment, print_table, time_device
from benchmarks.peers import MICROBATCHES_PER_STEP, RECIPE
from benchmarks.te_peers import TE_UNFUSED, te, te_stack_step, try_build

HIDDEN = [1024, 2048, 4096]
LAYERS, BATCH, SEQ = 4, 4, 2048


class LayerStack(nn.Module):
    """`layers` g8.TransformerLayers in sequence."""

    def __init__(self, hidden: int, heads: int, layers: int, seq: int, device):
        super().__init__()
        kw = dict(max_seq_len=seq, params_dtype=torch.bfloat16, device=device)
        self.layers = nn.ModuleList(
            g8.TransformerLayer(hidden, heads, 4 * hidden, **kw) for _ in range(layers)
        )

    def forward(self, x, is_first_microbatch=None):
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch)
        return x


def flops_per_microbatch(hidden: int, batch: int, seq: int, layers: int) -> float:
    """GEMM FLOPs (24 h^2 per token forward, x3 with the backward) plus causal attention (4 s h
    per token forward, half of it masked, x3.5 with the backward)."""
    tokens = batch * seq
    gemm = 3 * 24 * hidden**2 * tokens
    attention = 3.5 * 0.5 * 4 * seq * hidden * tokens
    return layers * (gemm + attention)


def _graphed_step(model, x, dy, fp8: bool, warmup: int):
    graphed = g8.make_graphed_callables(model, (x,), num_warmup_iters=warmup, fp8_enabled=fp8,
                                        fp8_recipe=RECIPE, fp8_weight_caching=fp8)  # fmt: skip

    def step(i):
        first = i % MICROBATCHES_PER_STEP == 0 if fp8 else None
        graphed(x, is_first_microbatch=first).backward(dy)

    return step


def _kernels_per_call(step, device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    from benchmarks.kernel_times import kernel_stats

    return sum(count for count, _ in kernel_stats(lambda: step(1), iters=2).values())


def bench_hidden(hidden: int, device, batch: int, seq: int, layers: int, iters: int,
                 repeats: int = 3) -> dict:  # fmt: skip
    heads = max(1, hidden // 128)
    torch.manual_seed(0)
    ref = LayerStack(hidden, heads, layers, seq, device)
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    row = {"hidden": hidden, "heads": heads, "layers": layers, "batch": batch, "seq": seq}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        model = LayerStack(hidden, heads, layers, seq, device)
        model.load_state_dict(ref.state_dict())
        step = _graphed_step(model, x, dy, fp8, warmup=min(3, repeats))
        counter = iter(range(10**9))
        call = lambda s=step, c=counter: s(next(c))  # noqa: E731
        row[f"{name}_ms"] = time_device(call, device, warmup=min(3, repeats), iters=iters,
                                        repeats=repeats)  # fmt: skip
        row[f"{name}_kernels"] = _kernels_per_call(step, device)
        del model, step
    row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
    row["fp8_tflops"] = flops_per_microbatch(hidden, batch, seq, layers) / row["fp8_ms"] / 1e9
    if te() is not None and torch.device(device).type == "cuda":
        _te_columns(row, x, dy, device, iters, repeats)
    return row


def _te_columns(row: dict, x, dy, device, iters: int, repeats: int) -> None:
    """te_ms, te_kernels and graphfp8 FP8's speed-up over TE (TE_UNFUSED), or te_error."""
    failures: dict = {}
    step = try_build("TE", lambda: te_stack_step(row["hidden"], row["heads"], row["layers"], x,
                                                 dy, MICROBATCHES_PER_STEP), failures)  # fmt: skip
    if step is None:
        row["te_error"] = failures["TE"]
        return
    counter = iter(range(10**9))
    call = lambda c=counter: step(next(c))  # noqa: E731
    row["te_ms"] = time_device(call, device, warmup=min(3, repeats), iters=iters, repeats=repeats)
    row["te_kernels"] = _kernels_per_call(step, device)
    row["fp8_vs_te"] = row["te_ms"] / row["fp8_ms"]


def run(device, quick: bool = False) -> dict:
    """quick: 2 layers of hidden 32 (one head) on batch 1 x seq 16, timed once: a smoke run for
    the CPU."""
    if quick:
        shapes, batch, seq, layers, iters, repeats = [32], 1, 16, 2, 1, 1
    else:
        shapes, batch, seq, layers, iters, repeats = HIDDEN, BATCH, SEQ, LAYERS, 10, 3
    rows = [bench_hidden(h, device, batch, seq, layers, iters, repeats) for h in shapes]
    text = _table(rows, layers, batch, seq, device)
    return {"env": environment(device), "stack": rows, "table": text}


def _table(rows, layers: int, batch: int, seq: int, device) -> str:
    te_cols = any("te_ms" in r for r in rows)
    header = ["hidden", "heads", "bf16 ms", "FP8 ms", "FP8 speed-up", "FP8 TFLOP/s",
              "bf16 kernels", "FP8 kernels"]  # fmt: skip
    if te_cols:
        header += [f"TE FP8 ms ({TE_UNFUSED})", "FP8 speed-up over TE", "TE kernels"]
    cells = []
    for r in rows:
        cell = [r["hidden"], r["heads"], r["bf16_ms"], r["fp8_ms"], r["speedup"], r["fp8_tflops"],
                r["bf16_kernels"] or "-", r["fp8_kernels"] or "-"]  # fmt: skip
        if te_cols:
            cell += [r.get("te_ms", "-"), r.get("fp8_vs_te", "-"), r.get("te_kernels") or "-"]
        cells.append(cell)
    text = print_table(
        f"{layers} TransformerLayers, batch {batch} x seq {seq}, fwd+bwd per microbatch, "
        f"graphed, {device}",
        header,
        cells,
    )
    for r in rows:
        if "te_error" in r:
            text += f"TE stack at hidden {r['hidden']} failed to build: {r['te_error']}\n"
    return text
