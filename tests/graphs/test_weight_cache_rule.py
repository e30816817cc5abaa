"""One weight-cache rule (graphfp8/fp8/weight_cache.py) for the eager module and the graphs'
device flag: None and True cast (and leave the cache valid), False reuses the cache, False before
any cast raises. A graphed call with None followed by one with False is the eager sequence (the
flag used to count only True calls, and raised there)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, T, build

RECIPE = g8.DelayedScaling(amax_history_len=4)
FIRSTS = [None, False, True, False, None, False]


def _loss(out, target):
    return (out.float() - target.float()).square().mean()


def _batches(device):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(T, H, generator=gen).to(device, torch.bfloat16),
             torch.randn(T, 2 * H, generator=gen).to(device, torch.bfloat16))
            for _ in FIRSTS]  # fmt: skip


def _eager(model, batches):
    losses = []
    for (x, y), first in zip(batches, FIRSTS, strict=True):
        with g8.fp8_autocast(recipe=RECIPE):
            loss = _loss(model(x, is_first_microbatch=first), y)
        loss.backward()
        with torch.no_grad():
            model.weight.mul_(0.5)  # an optimizer step: False must reuse the old cast
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("level", ["callables", "microbatch"])
def test_graphs_follow_the_eager_rule(device, level):
    batches = _batches(device)
    eager = build("Linear", device=device)
    model = copy.deepcopy(eager)  # its slots in arenas of its own
    x0, y0 = (t.clone() for t in batches[0])
    if level == "callables":
        g = g8.make_graphed_callables(model, (x0,), fp8_enabled=True, fp8_recipe=RECIPE,
                                      fp8_weight_caching=True)  # fmt: skip
        call = lambda x, y, first: _loss(g(x, is_first_microbatch=first), y)  # noqa: E731
    else:
        g = g8.make_graphed_microbatch(model, _loss, (x0, y0), fp8_enabled=True,
                                       fp8_recipe=RECIPE, fp8_weight_caching=True)  # fmt: skip
        call = lambda x, y, first: g((x, y), is_first_microbatch=first)  # noqa: E731
    with pytest.raises(RuntimeError, match="is_first_microbatch=False before any call"):
        call(*batches[1], False)
    losses = []
    for (x, y), first in zip(batches, FIRSTS, strict=True):
        loss = call(x, y, first)
        if level == "callables":
            loss.backward()
        with torch.no_grad():
            model.weight.mul_(0.5)
        losses.append(loss.detach().clone())
    for got, want in zip(losses, _eager(eager, batches), strict=True):
        assert_bitwise_equal(got, want, level)
    assert_bitwise_equal(model.weight.grad, eager.weight.grad, "grads")
