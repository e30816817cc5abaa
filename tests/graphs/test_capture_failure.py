"""A capture that fails, in warmup or in capture, leaves the process as it was: garbage collection
on, no capture state or hooks left, RNG and FP8 state restored, no arena frozen, the modules
eager and callable - and a later capture works. Failures are injected at each phase."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8 import context
from graphfp8.graphs import callables as capture_module
from graphfp8.graphs.grads import GradFold
from graphfp8.graphs.replay_guard import hook_dicts
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.modules.common import H, Stack, T, fp8_state

RECIPE = g8.DelayedScaling(amax_history_len=4)
WARMUP = 2


class _Injected(Exception):
    pass


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises on the call numbered `fail_at` (0-based)."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        box = ctx.box
        box["calls"] += 1
        if box["calls"] - 1 == box["fail_at"]:
            raise _Injected("backward")
        return dy, None


class _Faulty(torch.nn.Module):
    """A Stack whose forward (or backward) raises on a chosen call: call i < WARMUP is warmup,
    call WARMUP is the capture."""

    def __init__(self, stack, fwd_fail_at=-1, bwd_fail_at=-1, sync_at=-1):
        super().__init__()
        self.stack = stack
        self.fwd = {"calls": 0, "fail_at": fwd_fail_at}
        self.bwd = {"calls": 0, "fail_at": bwd_fail_at}
        self.sync_at = sync_at

    def forward(self, x, is_first_microbatch=None):
        call = self.fwd["calls"]
        self.fwd["calls"] += 1
        if call == self.fwd["fail_at"]:
            raise _Injected("forward")
        y = self.stack(x, is_first_microbatch=is_first_microbatch)
        if call == self.sync_at:
            y = y * float(y.detach().sum())  # a host read: a CaptureError inside the capture
        return _FailingBackward.apply(y, self.bwd)


def _fail(*args, **kwargs):
    raise _Injected("late")


CASES = {
    "warmup forward": dict(fwd_fail_at=1),
    "warmup backward": dict(bwd_fail_at=0),
    "capture forward": dict(fwd_fail_at=WARMUP),
    "capture host sync": dict(sync_at=WARMUP),
    "capture backward": dict(bwd_fail_at=WARMUP),
    "grad accumulator": dict(),
    "guard": dict(),
}


def _copy(model):
    """A deep copy with the same .grad (deepcopy leaves it out), whose FP8 slots live in an
    arena of their own (deepcopy's: the two models' updates never touch each other)."""
    new = copy.deepcopy(model)
    for p, q in zip(new.parameters(), model.parameters(), strict=True):
        p.grad = None if q.grad is None else q.grad.clone()
    return new


def _state_of(model):
    return (
        [t.clone() for _, t in fp8_state(model)],
        [p.detach().clone() for p in model.parameters()],
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
    )


@pytest.mark.parametrize("where", list(CASES))
def test_failed_capture_leaves_the_process_as_it_was(device, where, monkeypatch):
    stack = Stack(device=device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    with g8.fp8_autocast(recipe=RECIPE):  # FP8 state that is not fresh, and .grad set
        stack(x, is_first_microbatch=True).float().square().sum().backward()
    reference = _copy(stack)
    model = _Faulty(stack, **CASES[where])
    if where == "grad accumulator":  # the last steps of the capture
        monkeypatch.setattr(GradFold, "accumulator", _fail)
    elif where == "guard":
        monkeypatch.setattr(capture_module, "ReplayGuard", _fail)
    before = _state_of(stack)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state() if device == "cuda" else None
    with pytest.raises((_Injected, g8.CaptureError)):
        g8.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=RECIPE,
                                  fp8_weight_caching=True, num_warmup_iters=WARMUP)  # fmt: skip
    monkeypatch.undo()
    assert gc.isenabled()
    assert context.current() is context.OFF, "no FP8 context left pushed"
    assert not any(hook_dicts(list(model.modules())))
    assert torch.equal(torch.get_rng_state(), rng)
    if cuda_rng is not None:
        assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    for a, b in zip(_state_of(stack), before, strict=True):
        for ta, tb in zip(a, b, strict=True):
            assert (ta is None) == (tb is None)
            if ta is not None:
                assert_bitwise_equal(ta, tb, f"{where}: state restored")
    for m in model.modules():
        assert "forward" not in vars(m), f"{where}: {type(m).__name__} keeps its eager forward"
        meta = getattr(m, "fp8_meta", None)
        if meta is not None:
            assert not meta.fwd.arena.frozen and not meta.bwd.arena.frozen, where
    assert not any(hasattr(p, "_graphfp8_grad") for p in model.parameters())
    # The modules run eagerly exactly as an untouched copy does, and a new capture works.
    for m in (stack, reference):
        with g8.fp8_autocast(recipe=RECIPE):
            m(x, is_first_microbatch=True).float().square().sum().backward()
    compare_models(reference, stack, f"{where}: eager after the failed capture")
    eager = _copy(stack)
    g = g8.make_graphed_callables(stack, (x,), fp8_enabled=True, fp8_recipe=RECIPE,
                                  fp8_weight_caching=True)  # fmt: skip
    for mb in range(2):
        xe, xg = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        with g8.fp8_autocast(recipe=RECIPE):
            ye = eager(xe, is_first_microbatch=mb == 0)
        yg = g(xg, is_first_microbatch=mb == 0)
        ye.float().square().sum().backward()
        yg.float().square().sum().backward()
        assert_bitwise_equal(yg, ye, f"{where}: output of the later capture")
    compare_models(eager, stack, f"{where}: the later capture")


def test_failed_capture_of_fresh_modules_leaves_no_fp8_state():
    stack = Stack()
    model = _Faulty(stack, fwd_fail_at=0)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(_Injected):
        g8.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=RECIPE)
    assert all(getattr(m, "fp8_meta", None) is None for m in model.modules())
