"""is_first_microbatch=False with no cached FP8 weight raises before the forward changes any
FP8 state (it raised after the region's forward scale update had rolled the history)."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8


def test_false_with_nothing_cached_raises_before_the_forward_update():
    torch.manual_seed(0)
    layer = g8.Linear(32, 32)
    with g8.fp8_autocast():
        layer(torch.randn(16, 32))  # slots allocated, an amax recorded for the next update
    layer.load_state_dict(layer.state_dict())  # the cached FP8 weights are stale now
    meta = layer.fp8_meta
    before = [t.clone() for t in (meta.fwd.history(), meta.fwd.scales())]
    with g8.fp8_autocast(), pytest.raises(RuntimeError, match="no cached FP8 weight"):
        layer(torch.randn(16, 32), is_first_microbatch=False)
    assert torch.equal(meta.fwd.history(), before[0]) and torch.equal(meta.fwd.scales(), before[1])
    with g8.fp8_autocast():  # and a first microbatch still casts
        layer(torch.randn(16, 32), is_first_microbatch=True)
