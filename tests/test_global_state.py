"""graphfp8.reset_state() resets every piece of global state that graphfp8/global_state.py lists,
and every piece can be seen dirty first (so that the test can fail)."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8 import global_state
from graphfp8.fp8 import arena_check, into_grad, observe
from graphfp8.fp8.scale_schedule import SCHEDULE
from graphfp8.graphs import backends
from graphfp8.nvtx_ranges import enable_ranges
from graphfp8.ops import cudnn_sdpa

H, T = 32, 16


def _autocast_left_open():
    ctx = g8.fp8_autocast(recipe=g8.DelayedScaling(amax_history_len=2))
    ctx.__enter__()  # a region that never ended (an exception between enter and exit)
    return ctx  # alive: a collected generator would run its exit


def _log_left_open():
    ctx = SCHEDULE.logged()
    ctx.__enter__()  # a log that never closed
    return ctx


def _eager_fp8_layer():
    layer = g8.Linear(H, H, params_dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=g8.DelayedScaling(amax_history_len=2)):
        layer(torch.randn(T, H, dtype=torch.bfloat16))
    return layer


def _live_capture():
    layer = g8.Linear(H, H, params_dtype=torch.bfloat16)
    return layer, g8.make_graphed_callables(layer, (torch.randn(T, H, dtype=torch.bfloat16),))


DIRTY = {
    "the FP8 context stack (fp8/context.py)": _autocast_left_open,
    "scale schedule: queued backward updates, log (fp8/scale_schedule.py)": _log_left_open,
    "FP8 arena registry (fp8/scaling.py REGISTRY)": _eager_fp8_layer,
    "numerics observer (fp8/observe.py)": lambda: observe.install(object()),
    "live captures (graphs/lifecycle.py)": _live_capture,
    "capture streams (graphs/backends.py)": lambda: backends._CAPTURE_STREAMS.update(x=object()),
    "cuDNN SDPA graphs and handles (ops/cudnn_sdpa.py)": lambda: cudnn_sdpa._HANDLES.update(
        {0: object()}
    ),
    "NVTX ranges switch (nvtx_ranges.py)": lambda: enable_ranges(True),
    "WGRAD_INTO_GRAD's capture targets and eager scalars (fp8/into_grad.py)": lambda: (
        into_grad._EAGER_SCALARS.update(x=object())
    ),
    "recipes agreed per fp8_group (fp8/arena_check.py AGREED_RECIPES)": lambda: (
        arena_check.AGREED_RECIPES.update(x="DelayedScaling")
    ),
}


def test_every_registered_piece_has_a_test():
    assert sorted(e.name for e in global_state.entries()) == sorted(DIRTY)


@pytest.mark.parametrize("name", list(DIRTY))
def test_reset_state_resets_it(name, monkeypatch):
    monkeypatch.delenv("GRAPHFP8_NVTX", raising=False)
    entry = {e.name: e for e in global_state.entries()}[name]
    assert entry.is_fresh(), f"{name}: fresh after the fixture's reset_state()"
    kept = DIRTY[name]()
    assert not entry.is_fresh(), f"{name}: the test made it dirty"
    g8.reset_state()
    assert entry.is_fresh(), f"{name}: reset_state() reset it"
    del kept


def test_reset_state_releases_live_captures():
    layer, _ = _live_capture()
    fn = g8.make_graphed_callables(lambda x: x * 2.0, (torch.randn(T, H),))
    g8.reset_state()
    assert "forward" not in vars(layer), "the module has its eager forward back"
    with pytest.raises(RuntimeError, match=r"reset\(\) released its graphs"):
        fn(torch.randn(T, H))


def test_kept_state_says_why():
    kept = global_state.kept()
    assert kept and all(why for why in kept.values())
