"""Activation recompute inside every capture entry point (make_graphed_callables per layer,
make_graphed_microbatch, make_graphed_step) against eager training without recompute, bit for
bit after capture and after every step: losses, grads, weights, optimizer state, FP8 scales and
amax histories, delayed and current scaling, selective and full recompute. The recompute is
captured into the backward graph (its forward GEMMs run again there); the scale updates are the
graphs' own, once per microbatch and direction."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from tests.graphs.step_common import (
    B,
    H,
    S,
    compare_step,
    compare_training_state,
    eager_step,
    lm_batch,
    lm_loss,
)
from tests.modules.recompute_common import MODES, RECIPES, pair

N, STEPS = 2, 2
CAPTURE = dict(fp8_enabled=True, fp8_weight_caching=True, num_warmup_iters=1)


def _step_graph(model, opt, recipe, device):
    step = g8.make_graphed_step(model, lm_loss, opt, lm_batch(N, device, 99), N,
                                fp8_recipe=recipe, **CAPTURE)  # fmt: skip

    def run(batch):
        step(batch)
        return step

    return run, step.captured_ops()


def _microbatch_graph(model, opt, recipe, device):
    tokens, targets = lm_batch(1, device, 99)
    graphed = g8.make_graphed_microbatch(model, lm_loss, (tokens[0], targets[0]), N,
                                         fp8_recipe=recipe, **CAPTURE)  # fmt: skip

    def run(batch):
        for i in range(N):
            graphed((batch[0][i], batch[1][i]), is_first_microbatch=i == 0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run, graphed.captured_ops()


def _layer_graphs(model, opt, recipe, device):
    samples = tuple((torch.randn(B, S, H, dtype=torch.bfloat16, device=device,
                                 requires_grad=True),) for _ in model.blocks)  # fmt: skip
    blocks = g8.make_graphed_callables(tuple(model.blocks), samples, fp8_recipe=recipe, **CAPTURE)

    def run(batch):
        for i in range(N):
            first = i == 0
            with g8.fp8_autocast(recipe=recipe):
                h = model.embed(batch[0][i])
                for block in blocks:
                    h = block(h, is_first_microbatch=first)
                out = model.head(h, is_first_microbatch=first)
            (lm_loss(out, batch[1][i]) / N).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ops = [op for graph_ops in blocks[0].captured_ops().values() for op in graph_ops]
    return run, ops


ENTRIES = {"step": _step_graph, "microbatch": _microbatch_graph, "callables": _layer_graphs}


def _gemms(ops) -> int:
    return sum(op.startswith("aten::_scaled_mm") for op in ops)


@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_graphed_recompute_equals_eager_without(device, entry, mode, scaling):
    recipe = RECIPES[scaling]
    plain, recomputed, opt_p, opt_r = pair(mode, device)
    run, ops = ENTRIES[entry](recomputed, opt_r, recipe, device)
    compare_training_state(plain, recomputed, opt_p, opt_r, "after capture")
    for s in range(STEPS):
        batch = lm_batch(N, device, s)
        want = eager_step(plain, lm_loss, opt_p, batch, N, recipe=recipe)
        graphed = run(batch)
        if graphed is not None:
            compare_step(graphed, want, f"step {s}")
        compare_training_state(plain, recomputed, opt_p, opt_r, f"step {s}")
    if mode == "full":  # the backward graph runs the layers' four forward GEMMs again
        _, reference, _, opt = pair("none", device)
        _, plain_ops = ENTRIES[entry](reference, opt, recipe, device)
        assert _gemms(ops) > _gemms(plain_ops)
        assert ops.count("graphfp8::scale_update") == plain_ops.count("graphfp8::scale_update")
