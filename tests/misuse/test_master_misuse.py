"""MasterWeights misuse found in the round of notes/MISUSE.md: a second MasterWeights over the same
FP8 weights, an optimizer that does not hold the masters, and a masters checkpoint that fits
only in part - each raised nothing (or only after writing) and trained wrongly."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, T

CURRENT = g8.Float8CurrentScaling()


def _fp8_model():
    torch.manual_seed(0)
    with g8.fp8_model_init():
        return nn.Sequential(g8.Linear(H, H, params_dtype=torch.bfloat16),
                             g8.Linear(H, H, params_dtype=torch.bfloat16))  # fmt: skip


def test_a_second_live_master_weights_is_refused():
    """Reading one set's grads moves the FP8 weights' gradients into it: a second set would
    train on nothing."""
    model = _fp8_model()
    masters = g8.MasterWeights(model)
    with pytest.raises(ValueError, match=r"\['0.weight', '1.weight'\] already have fp32 masters"):
        g8.MasterWeights(model)
    del masters
    gc.collect()
    g8.MasterWeights(model)  # the first one is gone: allowed


def test_an_optimizer_without_the_masters_is_refused_before_anything_changes():
    model = _fp8_model()
    masters = g8.MasterWeights(model)
    opt = torch.optim.SGD([model[0].bias, model[1].bias], lr=0.1)  # the model's own biases only
    x = torch.randn(T, H, dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=CURRENT):
        model(x).float().square().sum().backward()
    bias = model[0].bias.detach().clone()
    with pytest.raises(ValueError, match=r"does not hold the fp32 masters of \['0.weight', "):
        masters.step(opt)
    assert_bitwise_equal(model[0].bias, bias, "the optimizer stepped")
    masters.step(torch.optim.SGD(masters.parameters(), lr=0.1))  # the right one goes through


def test_a_masters_checkpoint_is_checked_whole_before_any_copy():
    model = _fp8_model()
    masters = g8.MasterWeights(model)
    state = masters.state_dict()
    state["masters"]["0.weight"] = torch.ones(H, H)
    state["masters"]["1.weight"] = torch.zeros(H // 2, H)
    before = [m.detach().clone() for m in masters.masters]
    with pytest.raises(ValueError, match=r"the master of 1.weight is \(16, 32\) torch.float32"):
        masters.load_state_dict(state)
    for m, b in zip(masters.masters, before, strict=True):
        assert_bitwise_equal(m, b, "a master was overwritten")
