"""The scale schedule's log (graphfp8/fp8/scale_schedule.py): which arena updates when in one
training step, eagerly and at each graph level (graphed callables, microbatch graph, step
graph) - the same log for all four."""

from __future__ import annotations

import copy

import torch

import graphfp8 as g8
from graphfp8.fp8.scale_schedule import SCHEDULE
from tests.graphs.step_common import adamw
from tests.modules.common import H, Stack, T

RECIPE = g8.DelayedScaling(amax_history_len=4)
N = 3  # microbatches per step


def _labels(log) -> list[tuple[str, str]]:
    """(point, arena) -> (point, "forward 0"): arenas named by direction and first appearance,
    so logs of different models (an eager one, a captured copy) compare."""
    names: dict[int, str] = {}
    out = []
    for point, arena in log:
        if id(arena) not in names:
            k = sum(n.startswith(arena.direction) for n in names.values())
            names[id(arena)] = f"{arena.direction} {k}"
        out.append((point, names[id(arena)]))
    return out


def _loss(out, target):
    return (out.float() - target.float()).square().mean()


def _data(device):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(N, T, H, generator=gen).to(device, torch.bfloat16)
    return x, torch.randn(N, T, H, generator=gen).to(device, torch.bfloat16)


def _model(device):
    return Stack(device=device)


def _eager(model, x, y):
    for i in range(N):
        with g8.fp8_autocast(recipe=RECIPE):
            out = model(x[i], is_first_microbatch=i == 0)
        (_loss(out, y[i]) / N).backward()


def _callables(model, x, y):
    graphed = g8.make_graphed_callables(model, (x[0].clone(),), fp8_enabled=True,
                                        fp8_recipe=RECIPE, fp8_weight_caching=True)  # fmt: skip

    def step():
        for i in range(N):
            (_loss(graphed(x[i], is_first_microbatch=i == 0), y[i]) / N).backward()

    return step


def _microbatch(model, x, y):
    graphed = g8.make_graphed_microbatch(model, _loss, (x[0].clone(), y[0].clone()), N,
                                         fp8_enabled=True, fp8_recipe=RECIPE,
                                         fp8_weight_caching=True)  # fmt: skip

    def step():
        for i in range(N):
            graphed((x[i], y[i]), is_first_microbatch=i == 0)

    return step


def _step(model, x, y):
    opt = adamw(model.parameters(), x.device, lr=0.0)
    graphed = g8.make_graphed_step(model, _loss, opt, (x.clone(), y.clone()), N,
                                   fp8_enabled=True, fp8_recipe=RECIPE)  # fmt: skip
    return lambda: graphed((x, y))


def test_one_training_step_logs_the_same_schedule_at_every_level(device):
    x, y = _data(device)
    eager = _model(device)
    _eager(eager, x, y)  # the slots exist and have moved, as before a capture
    with SCHEDULE.logged() as log:
        _eager(eager, x, y)
    expected = [("forward", "forward 0"), ("backward", "backward 0")] * N
    assert _labels(log) == expected, "eager: each microbatch updates forward, then backward"
    for level in (_callables, _microbatch, _step):
        step = level(copy.deepcopy(_model(device)), x, y)
        step()
        with SCHEDULE.logged() as log:
            step()
        assert _labels(log) == expected, level.__name__
    assert SCHEDULE.is_fresh()


def test_a_capture_logs_nothing_and_nested_logs_are_separate(device):
    x, y = _data(device)
    with SCHEDULE.logged() as outer:
        step = _microbatch(_model(device), x, y)
        assert outer == [], "warmup and capture run no update (the graph holds them)"
        with SCHEDULE.logged() as inner:
            step()
        assert len(inner) == 2 * N and outer == []


def _nested(a, x, log=None):
    """Region {a; disabled {region {b}}; a}: returns b."""
    with g8.fp8_autocast(recipe=RECIPE):
        a(x)
        with g8.fp8_autocast(enabled=False), g8.fp8_autocast(recipe=RECIPE):
            b = g8.Linear(H, H, params_dtype=torch.bfloat16, device=x.device)
            b(x)
        a(x)
    return b


def test_a_region_nested_in_a_disabled_region_is_its_own(device):
    """enabled > disabled > enabled: the innermost region updates the arenas it uses, and the
    outer region's arena is not updated again when the outer region uses it after: `a` ends as
    after one region without the nesting. Before the FP8 context was a value, the region number
    was a global counter that the inner region moved on, and the outer region's arena was
    updated a second time within its one region."""
    a = g8.Linear(H, H, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(a)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    for _ in range(2):  # the second round starts from moved scales
        b = _nested(a, x)
        with g8.fp8_autocast(recipe=RECIPE):
            twin(x)
            twin(x)
    for mine, theirs in ((a.fp8_meta.fwd, twin.fp8_meta.fwd), (a.fp8_meta.bwd, twin.fp8_meta.bwd)):
        assert torch.equal(mine.history(), theirs.history())
        assert torch.equal(mine.scales(), theirs.scales())
    with SCHEDULE.logged() as log:
        b = _nested(a, x)
    assert [(p, arena) for p, arena in log] == [
        ("forward", a.fp8_meta.fwd.arena),
        ("forward", b.fp8_meta.fwd.arena),
    ]
