"""The capture options (graphs/options.py: one frozen value validated on construction, built by
each entry point) and the one rule set of what can be captured (graphs/capture_checks.py
check_capturable), checked in one order by all three entry points."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.graphs import session as session_module
from graphfp8.graphs.options import CaptureOptions
from tests.graphs.step_common import adamw
from tests.modules.common import H, T, build


def test_options_are_frozen_and_validated():
    opts = CaptureOptions("make_graphed_step", fp8_enabled=True, min_warmup=1)
    assert opts.recipe == g8.DelayedScaling() and not opts.caching
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.fp8_enabled = False
    assert CaptureOptions("e").recipe is None, "no recipe without FP8"
    cases = [
        (
            dict(num_warmup_iters=0, min_warmup=1),
            ValueError,
            "num_warmup_iters must be an int >= 1",
        ),
        (dict(num_warmup_iters=True), ValueError, "num_warmup_iters must be an int"),
        (dict(fp8_enabled=True, num_warmup_iters=0), ValueError, "fp8_enabled needs"),
        (dict(fp8_recipe="hybrid"), TypeError, "e: fp8_recipe: recipe must be"),
    ]
    for kwargs, kind, pattern in cases:
        with pytest.raises(kind, match=pattern):
            CaptureOptions("e", **kwargs)


def _loss(out, target):
    return F.mse_loss(out.float(), target.float())


def _capture(entry: str, model, x):
    y = torch.zeros(T, 2 * H, dtype=torch.bfloat16)
    if entry == "callables":
        return g8.make_graphed_callables(model, (x,), fp8_enabled=True)
    if entry == "microbatch":
        return g8.make_graphed_microbatch(model, _loss, (x, y), fp8_enabled=True)
    return g8.make_graphed_step(model, _loss, adamw(model.parameters(), "cpu"),
                                (x[None], y[None]), fp8_enabled=True)  # fmt: skip


@pytest.mark.parametrize("entry", ["callables", "microbatch", "step"])
def test_each_entry_point_hands_its_options_to_the_session(entry, monkeypatch):
    seen = []
    real = session_module.CaptureSession.__init__

    def spy(self, device, options, **kwargs):
        seen.append(options)
        real(self, device, options, **kwargs)

    monkeypatch.setattr(session_module.CaptureSession, "__init__", spy)
    _capture(entry, build("Linear"), torch.randn(T, H, dtype=torch.bfloat16))
    (opts,) = seen
    assert opts.entry == f"make_graphed_{entry}" and opts.fp8_enabled
    assert opts.fp8_weight_caching == (entry == "step"), "the documented defaults"
    assert opts.num_warmup_iters == 3 and opts.recipe == g8.DelayedScaling()


@pytest.mark.parametrize("entry", ["callables", "microbatch", "step"])
def test_the_rules_are_checked_in_one_order(entry):
    """A module that replays a live capture and has a hook: every entry point names the live
    capture first (the microbatch and step graphs named the hook before check_capturable)."""
    x = torch.randn(T, H, dtype=torch.bfloat16)
    layer = build("Linear")
    g8.make_graphed_callables(layer, (x,), fp8_enabled=True)
    model = torch.nn.Sequential(layer)
    model.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="which an earlier make_graphed_callables already"):
        _capture(entry, model, x)
