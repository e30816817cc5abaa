"""fuse_wgrad_accumulation inside every capture entry point (make_graphed_callables,
make_graphed_microbatch, make_graphed_step) against the same eager training, bit for bit: the
main gradients (put back after warmup and capture, then added into by every replay), the other
gradients, losses, weights, optimizer state, FP8 scales and amax histories."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import (
    RECIPE,
    B,
    H,
    S,
    TinyLM,
    adamw,
    compare_step,
    compare_training_state,
    eager_step,
    lm_batch,
    lm_loss,
)
from tests.helpers import DEVICES
from tests.modules.common import fp8_state
from tests.modules.test_fuse_wgrad import fuse, gemm_weights

N, STEPS = 2, 2
CAPTURE = dict(fp8_enabled=True, fp8_recipe=RECIPE, num_warmup_iters=1)


def _pair(device):
    torch.manual_seed(0)
    eager = fuse(TinyLM(device), start=None)
    graphed = copy.deepcopy(eager)
    for we, wg in zip(gemm_weights(eager), gemm_weights(graphed), strict=True):
        wg.main_grad = we.main_grad.clone()
    return eager, graphed


def _added_to(model, starts) -> None:
    """Every main_grad moved away from its start (the comparisons are not of untouched tensors)."""
    for w, s in zip(gemm_weights(model), starts, strict=True):
        assert not torch.equal(w.main_grad, s)


def _compare(eager, graphed, what, grads=True):
    """main_grads, FP8 state and (grads) every other .grad, bit for bit; fused weights no .grad.
    After a capture the graphs' .grad buffers are not compared (the graphs' own rule)."""
    for (name, pe), (_, pg) in zip(eager.named_parameters(), graphed.named_parameters(),
                                   strict=True):  # fmt: skip
        if any(pe is w for w in gemm_weights(eager)):
            assert pe.grad is None and pg.grad is None, f"{what}: .grad of fused {name}"
            assert_bitwise_equal(pg.main_grad, pe.main_grad, f"{what}: main_grad of {name}")
        elif not grads:
            continue
        elif pe.grad is None:
            assert pg.grad is None, f"{what}: .grad of {name}"
        else:
            assert_bitwise_equal(pg.grad, pe.grad, f"{what}: grad of {name}")
    if not grads:  # after capture: the eager model may not have run in FP8 yet
        return
    for (name, se), (_, sg) in zip(fp8_state(eager), fp8_state(graphed), strict=True):
        assert_bitwise_equal(sg, se, f"{what}: {name}")


def _eager_microbatches(model, batch):
    for i in range(N):
        with g8.fp8_autocast(recipe=RECIPE):
            out = model(batch[0][i], is_first_microbatch=i == 0)
        (lm_loss(out, batch[1][i]) / N).backward()


@pytest.mark.parametrize("device", DEVICES)
def test_graphed_callables_equal_eager(device):
    eager, model = _pair(device)
    starts = [w.main_grad.clone() for w in gemm_weights(model)]
    sample = (torch.randn(B, S, H, dtype=torch.bfloat16, device=device, requires_grad=True),)
    (block,) = g8.make_graphed_callables((model.block,), (sample,), fp8_weight_caching=True,
                                         **CAPTURE)  # fmt: skip
    _compare(eager, model, "after capture", grads=False)
    for step in range(STEPS):
        batch = lm_batch(N, device, step)
        _eager_microbatches(eager, batch)
        for i in range(N):
            first = i == 0
            with g8.fp8_autocast(recipe=RECIPE):
                h = block(model.embed(batch[0][i]), is_first_microbatch=first)
                out = model.head(model.norm(h), is_first_microbatch=first)
            (lm_loss(out, batch[1][i]) / N).backward()
        _compare(eager, model, f"step {step}")
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
    _added_to(model, starts)


@pytest.mark.parametrize("device", DEVICES)
def test_graphed_microbatch_equals_eager(device):
    eager, model = _pair(device)
    starts = [w.main_grad.clone() for w in gemm_weights(model)]
    tokens, targets = lm_batch(1, device, 99)
    graphed = g8.make_graphed_microbatch(model, lm_loss, (tokens[0], targets[0]), N,
                                         fp8_weight_caching=True, **CAPTURE)  # fmt: skip
    _compare(eager, model, "after capture", grads=False)
    for step in range(STEPS):
        batch = lm_batch(N, device, step)
        _eager_microbatches(eager, batch)
        for i in range(N):
            graphed((batch[0][i], batch[1][i]), is_first_microbatch=i == 0)
        _compare(eager, model, f"step {step}")
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
    _added_to(model, starts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_graphed_step_equals_eager(max_grad_norm, device):
    """The optimizer skips the fused weights (no .grad), eagerly and in the graph alike; their
    main gradients keep accumulating across steps."""
    eager, model = _pair(device)
    starts = [w.main_grad.clone() for w in gemm_weights(model)]
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)
    step = g8.make_graphed_step(model, lm_loss, opt_g, lm_batch(N, device, 99), N,
                                max_grad_norm=max_grad_norm, **CAPTURE)  # fmt: skip
    compare_training_state(eager, model, opt_e, opt_g, "after capture")
    _compare(eager, model, "after capture", grads=False)
    for s in range(STEPS):
        batch = lm_batch(N, device, s)
        result = eager_step(eager, lm_loss, opt_e, batch, N, recipe=RECIPE,
                            max_grad_norm=max_grad_norm)  # fmt: skip
        step(batch)
        compare_step(step, result, f"step {s}")
        compare_training_state(eager, model, opt_e, opt_g, f"step {s}")
        for we, wg in zip(gemm_weights(eager), gemm_weights(model), strict=True):
            assert_bitwise_equal(wg.main_grad, we.main_grad, f"step {s}: main_grad")
    _added_to(model, starts)
