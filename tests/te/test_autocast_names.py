"""g8.fp8_autocast under TransformerEngine's argument names (fp8_recipe=) and g8.autocast, TE 2.x's
name (recipe=, amax_reduction_group=): the same region as fp8_autocast(recipe=...)."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8 import context


def _run(enter) -> tuple[torch.Tensor, torch.Tensor]:
    """Two FP8 steps of a fresh LayerNormMLP inside the region `enter()` opens: (the second
    output, fc1's weight gradient), both depending on the scales the first step set."""
    torch.manual_seed(0)
    layer = g8.LayerNormMLP(32, 64, params_dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    for _ in range(2):
        with enter():
            y = layer(x)
        y.float().sum().backward()
    return y, layer.fc1_weight.grad


def test_fp8_recipe_and_autocast_spell_the_same_region():
    recipe = g8.DelayedScaling(amax_history_len=4)
    ref = _run(lambda: g8.fp8_autocast(enabled=True, recipe=recipe))
    g8.reset_state()
    te_old = _run(lambda: g8.fp8_autocast(enabled=True, fp8_recipe=recipe))  # TypeError before
    g8.reset_state()
    te_new = _run(lambda: g8.autocast(enabled=True, recipe=recipe, amax_reduction_group=None))
    for got in (te_old, te_new):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_the_recipe_reaches_the_state():
    recipe = g8.Float8CurrentScaling()
    with g8.fp8_autocast(fp8_recipe=recipe):
        assert context.current().enabled and context.current().recipe is recipe
    with g8.autocast(True, False, recipe):  # TE's positional order
        assert context.current().enabled and context.current().recipe is recipe
    with g8.autocast(enabled=False):
        assert not context.current().enabled


def test_misspellings_raise():
    recipe = g8.DelayedScaling()
    with pytest.raises(TypeError, match="not both"):
        with g8.fp8_autocast(recipe=recipe, fp8_recipe=recipe):
            pass
    with pytest.raises(NotImplementedError, match="calibrating"):
        g8.autocast(calibrating=True)
    with pytest.raises(TypeError, match="recipe"):
        with g8.autocast(recipe="hybrid"):
            pass
    assert context.current() is context.OFF, "no region left open"
