"""make_graphed_step == the eager training step, bit for bit, after every step: losses, gradient
norms, grads before and after clipping, parameters, optimizer state, FP8 scales and histories
(the CPU tape in CI, CUDA graphs with `make test-gpu`)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

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
from tests.modules.common import H, T, build

N = 3  # microbatches per step
STEPS = 3


def _lr_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _train(device, model, loss_fn, batch_fn, *, fp8=True, caching=True, max_grad_norm=None):
    """Trains `model` and its copy eagerly and through make_graphed_step (AdamW, an LR
    schedule), comparing everything after capture and after every step."""
    eager, model = model, copy.deepcopy(model)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)
    sched_e, sched_g = _lr_schedule(opt_e), _lr_schedule(opt_g)
    step = g8.make_graphed_step(
        model, loss_fn, opt_g, batch_fn(99), N, fp8_enabled=fp8, fp8_recipe=RECIPE,
        fp8_weight_caching=caching, max_grad_norm=max_grad_norm, num_warmup_iters=1,
        keep_grads_before_clipping=True,
    )  # fmt: skip
    compare_training_state(eager, model, opt_e, opt_g, "after capture")
    for s in range(STEPS):
        batch = batch_fn(s)
        result = eager_step(eager, loss_fn, opt_e, batch, N, fp8=fp8, caching=caching,
                            max_grad_norm=max_grad_norm)  # fmt: skip
        step(batch)
        compare_step(step, result, f"step {s}")
        compare_training_state(eager, model, opt_e, opt_g, f"step {s}")
        sched_e.step()
        sched_g.step()
    return step


def test_step_equals_eager_fp8_adamw_lr_schedule_clipping(device):
    """The whole model (embedding, FP8 transformer layer, head, cross entropy) in one graph."""
    step = _train(device, TinyLM(device), lm_loss, lambda s: lm_batch(N, device, s),
                  max_grad_norm=0.5)  # fmt: skip
    ops = step.captured_ops()
    # One forward and one backward arena update per microbatch, all inside the one graph.
    assert ops.count("graphfp8::scale_update") == 2 * N


def test_step_equals_eager_without_fp8(device):
    step = _train(device, TinyLM(device), lm_loss, lambda s: lm_batch(N, device, s), fp8=False,
                  max_grad_norm=1.0)  # fmt: skip
    assert "graphfp8::scale_update" not in step.captured_ops()


def _mse(y, target):
    return F.mse_loss(y.float(), target.float())


def _mlp_batch(device, seed: int):
    """N microbatches of (input, target) for LayerNormMLP (T, H)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, T, H, generator=gen).to(torch.bfloat16)
    x[1:] *= 10.0  # other amaxes per microbatch: the scales move within a step
    return x.to(device), torch.randn(N, T, H, generator=gen).to(device)


def test_step_equals_eager_without_weight_caching_or_clipping(device):
    batch = lambda seed: _mlp_batch(device, seed)  # noqa: E731
    step = _train(device, build("LayerNormMLP", device=device), _mse, batch, caching=False)
    assert step.grad_norm is None


def test_launch_only_replays_the_same_step(device):
    """launch_only() (the bench's host-cost probe) replays exactly what a call does, on the
    static batch the caller filled: same loss, parameters and optimizer state, bit for bit."""
    called = build("LayerNormMLP", device=device)
    launched = copy.deepcopy(called)
    opt_c, opt_l = adamw(called.parameters(), device), adamw(launched.parameters(), device)
    kw = dict(fp8_enabled=True, fp8_recipe=RECIPE, max_grad_norm=1.0, num_warmup_iters=1)
    step_c = g8.make_graphed_step(called, _mse, opt_c, _mlp_batch(device, 99), N, **kw)
    step_l = g8.make_graphed_step(launched, _mse, opt_l, _mlp_batch(device, 99), N, **kw)
    for s in range(2):
        x, y = _mlp_batch(device, s)
        step_c((x, y))
        inputs, targets = step_l.static_batch
        inputs.copy_(x)
        targets.copy_(y)
        step_l.launch_only()
        assert torch.equal(step_l.loss, step_c.loss), f"step {s}: loss"
        compare_training_state(called, launched, opt_c, opt_l, f"step {s}")
