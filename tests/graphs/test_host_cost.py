"""Host work per call is flat in model size (issue 26): for each entry point, what one call runs
on the host - Python bytecodes executed, Python frames entered, C functions called from Python,
and torch ops dispatched - counted with the CPU tape's replay switched off (so what is counted
is the checks, copies and bookkeeping, not the kernels), is the same at 4 layers as at 1.
Counts, not times: they cannot flake under load. A loop inside one C call (an `any(...)` over
every parameter in C, a foreach op over every tensor) counts once: its time per layer is what
`python -m benchmarks host` shows (host time at 24 layers over 1; docs/benchmarking.md)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import graphfp8 as g8
from benchmarks.peers import G8Stack
from graphfp8.graphs.backends import tape_replays_off

H, T, N = 16, 16, 2
RECIPE = g8.DelayedScaling(amax_history_len=4)
FP8 = dict(fp8_enabled=True, fp8_recipe=RECIPE, num_warmup_iters=1)


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


class _Ops(TorchDispatchMode):
    """Counts the torch ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _host_work(call) -> dict[str, int]:
    """What one call of `call` runs on the host (module docstring), counted."""
    n = {"bytecodes": 0, "frames": 0, "c_calls": 0}

    def trace(frame, event, arg):
        if event == "call":
            n["frames"] += 1
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        elif event == "opcode":
            n["bytecodes"] += 1
        return trace

    def profile(frame, event, arg):
        if event == "c_call":
            n["c_calls"] += 1

    previous = sys.gettrace(), sys.getprofile()
    sys.setprofile(profile)
    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(previous[0])
        sys.setprofile(previous[1])
    with _Ops() as ops:
        call()
    return {**n, "torch ops": ops.count}


@pytest.mark.parametrize("entry", ["callables", "microbatch", "step"])
def test_host_work_per_call_does_not_grow_with_layers(entry):
    work = {}
    with tape_replays_off():
        for layers in (1, 4):
            call = _call(entry, layers)
            call()  # the first call's one-time work (caches) is not per call
            work[layers] = _host_work(call)
    assert work[1]["bytecodes"] > 100, work  # the counters count
    assert work[4] == work[1], f"{entry}: host work per call at 1 and 4 layers: {work}"
