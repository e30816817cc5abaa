"""Host work per call is flat in model size (issue 26): for each entry point, the time of one call
at 24 layers over the time at 1 layer, in one process, with the CPU tape's replay switched off
(so what is timed is the checks, copies and bookkeeping, not the kernels). A ratio with a
generous bound, never an absolute time; counting Python calls alone would miss loops inside C
calls (an `any(...)` over every parameter is one Python call)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from benchmarks.peers import G8Stack
from graphfp8.graphs.backends import tape_replays_off

H, T, N = 16, 16, 2
RECIPE = g8.DelayedScaling(amax_history_len=4)
FP8 = dict(fp8_enabled=True, fp8_recipe=RECIPE, num_warmup_iters=1)
# Measured on the 2-core CI machine: ~1.1x (callables), ~1.15x (step), ~1.3x (microbatch: its
# call is the cheapest, ~5 us, of which ~1 us is the two C++ loops over 144 tensors at 24
# layers); before the O(1) guard 2.8x, 1.9x and 3.3x.
BOUND = 1.5


def _mse(y, target):
    return F.mse_loss(y.float(), target.float())


def _call(entry: str, layers: int):
    """One training call of `entry` over a stack of `layers` FP8 LayerNormMLP blocks."""
    torch.manual_seed(0)
    model = G8Stack(H, layers, device="cpu")
    x = torch.randn(N, T, H, dtype=torch.bfloat16)
    batch = (x, torch.randn_like(x))
    if entry == "callables":
        sample = x[0].clone().requires_grad_()
        g = g8.make_graphed_callables(model, (sample,), fp8_weight_caching=True, **FP8)
        dy = torch.randn_like(x[0])
        g(sample, is_first_microbatch=True).backward(dy)
        return lambda: g(sample, is_first_microbatch=False).backward(dy)
    if entry == "microbatch":
        g = g8.make_graphed_microbatch(model, _mse, (x[0], x[1]), **FP8)
        return lambda: g((x[0], x[1]))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True)
    g = g8.make_graphed_step(model, _mse, opt, batch, N, **FP8)
    return lambda: g(batch)


def _best_us(call, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls * 1e6


@pytest.mark.parametrize("entry", ["callables", "microbatch", "step"])
def test_host_work_per_call_does_not_grow_with_layers(entry):
    calls = {layers: _call(entry, layers) for layers in (1, 24)}
    best = {layers: float("inf") for layers in calls}
    with tape_replays_off():
        for call in calls.values():
            _best_us(call, 20)
        for _ in range(15):  # interleaved, the fastest repeat of each: robust to other jobs
            for layers, call in calls.items():
                best[layers] = min(best[layers], _best_us(call, 100))
    ratio = best[24] / best[1]
    assert ratio < BOUND, (
        f"{entry}: {best[24]:.1f} us per call at 24 layers, {best[1]:.1f} us at 1: "
        f"{ratio:.2f}x (bound {BOUND}x)"
    )
