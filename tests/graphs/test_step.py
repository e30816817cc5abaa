"""make_graphed_step == the eager training step, bit for bit, after every step: losses, gradient
norms, grads before and after clipping, parameters, optimizer state, FP8 scales and histories
(the CPU tape in CI, CUDA graphs with `make test-gpu`)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from tests.graphs.step_common import (
    RECIPE,
    TinyLM,
    adamw,
    compare_step,
    compare_training_state,
    eager_step,
    lm_batch,
    lm_loss,
)

N = 3  # microbatches per step
STEPS = 3


def _lr_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _train(device, *, fp8=True, caching=True, max_grad_norm=None, make_opt=adamw,
           schedule=True):  # fmt: skip
    eager = TinyLM(device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = make_opt(eager.parameters(), device), make_opt(model.parameters(), device)
    sched_e = _lr_schedule(opt_e) if schedule else None
    sched_g = _lr_schedule(opt_g) if schedule else None
    sample = lm_batch(N, device, seed=99)
    step = g8.make_graphed_step(
        model, lm_loss, opt_g, sample, N, fp8_enabled=fp8, fp8_recipe=RECIPE,
        fp8_weight_caching=caching, max_grad_norm=max_grad_norm, num_warmup_iters=1,
        keep_grads_before_clipping=True,
    )  # fmt: skip
    compare_training_state(eager, model, opt_e, opt_g, "after capture")
    for s in range(STEPS):
        batch = lm_batch(N, device, seed=s)
        result = eager_step(eager, lm_loss, opt_e, batch, N, fp8=fp8, caching=caching,
                            max_grad_norm=max_grad_norm)  # fmt: skip
        step(batch)
        compare_step(step, result, f"step {s}")
        compare_training_state(eager, model, opt_e, opt_g, f"step {s}")
        if schedule:
            sched_e.step()
            sched_g.step()
    return step


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_step_equals_eager_fp8_adamw_with_lr_schedule(device, max_grad_norm):
    step = _train(device, max_grad_norm=max_grad_norm)
    ops = step.captured_ops()
    # One forward and one backward arena update per microbatch, all inside the one graph.
    assert ops.count("graphfp8::scale_update") == 2 * N


def test_step_equals_eager_without_fp8(device):
    step = _train(device, fp8=False, max_grad_norm=1.0)
    assert "graphfp8::scale_update" not in step.captured_ops()


def test_step_equals_eager_without_weight_caching(device):
    _train(device, caching=False, max_grad_norm=1.0, schedule=False)
