"""An eval pass between a step's training microbatches (issue 25, row 7; issue 39, item 2: with
any is_first_microbatch): eager, and a graphed module's eager fallback, leave the cached FP8
weights and the delayed-scaling state alone, so training is bit for bit the run without the eval
pass."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.modules.common import build, fp8_state, input_shape

RECIPE = g8.DelayedScaling(amax_history_len=4)


def _eval_input(shape, device) -> torch.Tensor:
    # Its own generator (the training data stays the same) and 50x larger than the training
    # data: an amax it recorded would change the next scales.
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(shape, generator=gen) * 50).to(torch.bfloat16).to(device)


def _train(model, graphed: bool, eval_pass: bool, device, steps=2, mbs=3):
    """Trains `model` (eagerly or graphed) with an eval pass after microbatch 0 of every step
    when `eval_pass`. Returns the outputs of the training microbatches and of the eval passes."""
    shape = input_shape(model)
    call = model
    if graphed:
        sample = torch.randn(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
        call = g8.make_graphed_callables(model, (sample,), fp8_enabled=True, fp8_recipe=RECIPE,
                                         fp8_weight_caching=True, num_warmup_iters=1)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outs, evals = [], []
    torch.manual_seed(0)
    for _ in range(steps):
        for mb in range(mbs):
            x = torch.randn(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
            with g8.fp8_autocast(recipe=RECIPE):
                y = call(x, is_first_microbatch=mb == 0)
            outs.append(y.detach().clone())
            y.float().square().sum().backward()
            if eval_pass and mb == 0:
                model.eval()
                with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
                    evals.append(call(_eval_input(shape, device), is_first_microbatch=False))
                model.train()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, evals


def _twins(kind: str, device, first: tuple, second: tuple):
    """Two copies of one model, trained by _train with (graphed, eval_pass) `first` and
    `second`. Returns (model, outputs, eval outputs) of each."""
    base = build(kind, device=device)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    return (a, *_train(a, *first, device)), (b, *_train(b, *second, device))


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "Stack"])
def test_eval_pass_changes_no_training_state(device, kind, graphed):
    (plain, outs_plain, _), (with_eval, outs_eval, _) = _twins(
        kind, device, (graphed, False), (graphed, True)
    )
    for i, (a, b) in enumerate(zip(outs_plain, outs_eval, strict=True)):
        assert_bitwise_equal(b, a, f"training microbatch {i}")
    compare_models(plain, with_eval, "after training")


@pytest.mark.parametrize("kind", ["Linear", "Stack"])
def test_graphed_eval_fallback_equals_eager_eval(device, kind):
    """The eval outputs themselves: the graphed module's eager fallback computes what the eager
    module does (the cached FP8 weights and the current scales)."""
    (_, _, evals_e), (_, _, evals_g) = _twins(kind, device, (False, True), (True, True))
    for i, (e, g) in enumerate(zip(evals_e, evals_g, strict=True)):
        assert_bitwise_equal(g, e, f"eval pass {i}")


@pytest.mark.parametrize("flag", [False, True, None])
def test_an_eval_pass_changes_no_fp8_state_whatever_its_flag(device, flag):
    """Every eval call freezes the state (issue 39, item 2; before, only False did: True and None
    recorded amaxes and recast the cached weights)."""
    m = build("Linear", device=device)
    x = torch.randn(input_shape(m), dtype=torch.bfloat16, device=device)
    with g8.fp8_autocast(recipe=RECIPE):
        m(x, is_first_microbatch=True)
    before = [t.clone() for _, t in fp8_state(m)]
    m.eval()
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
        m(_eval_input(x.shape, device), is_first_microbatch=flag)
    for (name, t), b in zip(fp8_state(m), before, strict=True):
        assert_bitwise_equal(t, b, f"after an eval pass with {flag}: {name}")
