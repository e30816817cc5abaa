"""More step graphs against their eager loops, bit for bit: SGD with momentum, Adam with amsgrad,
many steps enqueued back to back, and the per-microbatch graph with the caller's own optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.graphs.step_common import RECIPE, compare_step, compare_training_state, eager_step
from tests.modules.common import H, T, build

N = 3


def mse(y, target):
    return F.mse_loss(y.float(), target.float())


def _batch(device, seed, n=N, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, H, generator=gen).to(dtype).to(device)
    x[1:] *= 10.0  # other amaxes per microbatch: the scales move within a step
    return x, torch.randn(n, T, H, generator=gen).to(device)


def _sgd(params, device):
    return torch.optim.SGD(params, lr=torch.tensor(0.05, device=device), momentum=0.9,
                           dampening=0.1, weight_decay=0.01, fused=True)  # fmt: skip


def _adam_amsgrad(params, device):
    kind = dict(capturable=True) if torch.device(device).type == "cuda" else dict(fused=True)
    return torch.optim.Adam(params, lr=torch.tensor(1e-2, device=device), amsgrad=True,
                            weight_decay=0.01, **kind)  # fmt: skip


# float32 parameters for SGD: torch 2.13's fused CPU SGD writes garbage into some elements of
# bfloat16 momentum buffers (seen eagerly too, ~1 call in 6 at 32 elements).
@pytest.mark.parametrize(
    "make_opt, dtype",
    [(_sgd, torch.float32), (_adam_amsgrad, torch.bfloat16)],
    ids=["sgd_momentum", "adam_amsgrad"],
)
def test_step_equals_eager_other_optimizers(device, make_opt, dtype):
    eager = build("LayerNormMLP", dtype=dtype, device=device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = make_opt(eager.parameters(), device), make_opt(model.parameters(), device)
    # SGD creates its momentum buffers on the first step: that one runs eagerly, on both.
    first = _batch(device, 100, dtype=dtype)
    for m, o in ((eager, opt_e), (model, opt_g)):
        eager_step(m, mse, o, first, N, max_grad_norm=1.0)
    sample = _batch(device, 99, dtype=dtype)
    step = g8.make_graphed_step(
        model, mse, opt_g, sample, N, fp8_enabled=True, fp8_recipe=RECIPE, max_grad_norm=1.0,
        num_warmup_iters=1,
    )  # fmt: skip
    for s in range(2):
        batch = _batch(device, s, dtype=dtype)
        result = eager_step(eager, mse, opt_e, batch, N, max_grad_norm=1.0)
        step(batch)
        compare_step(step, result, f"step {s}")
        compare_training_state(eager, model, opt_e, opt_g, f"step {s}")


def test_many_steps_back_to_back(device):
    """Steps enqueued without any synchronisation (static batch filled in place) end where the
    eager loop ends."""
    eager = build("LayerNormMLP", device=device)
    model = copy.deepcopy(eager)
    kind = dict(capturable=True) if torch.device(device).type == "cuda" else dict(fused=True)
    opt_e, opt_g = (torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2, device=device), **kind)
                    for m in (eager, model))  # fmt: skip
    step = g8.make_graphed_step(model, mse, opt_g, _batch(device, 99), N, fp8_enabled=True,
                                fp8_recipe=RECIPE, num_warmup_iters=1)  # fmt: skip
    batches = [_batch(device, s) for s in range(5)]
    losses = []
    for batch in batches:
        for static, t in zip(step.static_batch, batch, strict=True):
            static.copy_(t)
        losses.append(step(tuple(step.static_batch)).clone())
    for s, batch in enumerate(batches):
        loss, *_ = eager_step(eager, mse, opt_e, batch, N)
        assert_bitwise_equal(losses[s], loss, f"step {s}: loss")
    compare_training_state(eager, model, opt_e, opt_g, "end")


def test_microbatch_graph_with_the_callers_optimizer(device):
    """One graph per microbatch (forward + loss + backward, replayed from this thread); the loop
    keeps its own optimizer (not capturable), clipping and zero_grad (set_to_none=False: the
    first step copies into .grad, the later ones add)."""
    eager = build("LayerNormMLP", device=device)
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x0, t0 = _batch(device, 99, n=1)
    graphed = g8.make_graphed_microbatch(model, mse, (x0[0], t0[0]), N, fp8_enabled=True,
                                         fp8_recipe=RECIPE, fp8_weight_caching=True,
                                         num_warmup_iters=1)  # fmt: skip
    for s in range(3):
        x, target = _batch(device, s)
        for i in range(N):
            with g8.fp8_autocast(recipe=RECIPE):
                y = eager(x[i], is_first_microbatch=i == 0)
            loss_e = mse(y, target[i]) / N
            loss_e.backward()
            loss_g = graphed((x[i], target[i]), is_first_microbatch=i == 0)
            assert_bitwise_equal(loss_g, loss_e.detach(), f"step {s} mb {i}: loss")
            compare_models(eager, model, f"step {s} mb {i}")
        for m, o in ((eager, opt_e), (model, opt_g)):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad(set_to_none=False)
        compare_training_state(eager, model, opt_e, opt_g, f"step {s}")
    assert graphed.captured_ops().count("graphfp8::scale_update") == 2
