"""Eager activation recompute (graphfp8.recompute, TransformerLayer(recompute=...)) against the
same training without it, bit for bit: losses, grads, weights, optimizer state, FP8 scales and
amax histories, under delayed and current scaling; the scale updates that run, the casts the
numerics observer sees, a forward update between a forward and its backward, and the activation
bytes recompute frees (graphfp8.memory.LiveBytes)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8 import observe
from graphfp8.fp8.scale_schedule import SCHEDULE
from graphfp8.memory import LiveBytes
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import compare_training_state, eager_step, lm_batch, lm_loss
from tests.modules.attention_common import DPA, MHA, layer_and_input
from tests.modules.common import fp8_state
from tests.modules.recompute_common import MODES, RECIPES, RecomputeLM, pair

N, STEPS = 2, 2


@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("mode", MODES)
def test_eager_recompute_equals_no_recompute(device, mode, scaling):
    recipe = RECIPES[scaling]
    plain, recomputed, opt_p, opt_r = pair(mode, device)
    for s in range(STEPS):
        batch = lm_batch(N, device, s)
        with SCHEDULE.logged() as log_p:
            want = eager_step(plain, lm_loss, opt_p, batch, N, recipe=recipe)
        with SCHEDULE.logged() as log_r:
            got = eager_step(recomputed, lm_loss, opt_r, batch, N, recipe=recipe)
        assert [p for p, _ in log_r] == [p for p, _ in log_p], "the scale updates that ran"
        assert_bitwise_equal(got[0], want[0], f"step {s}: loss")
        for i, (g, w) in enumerate(zip(got[2], want[2], strict=True)):
            assert_bitwise_equal(g, w, f"step {s}: grad {i}")
        compare_training_state(plain, recomputed, opt_p, opt_r, f"step {s}")


class _Casts:
    """A numerics observer that lists every cast it is told of."""

    def __init__(self):
        self.seen = []

    def cast(self, block, i, role, source):
        self.seen.append((block.start + i, role))


def test_recomputed_casts_are_not_observed_twice():
    plain, recomputed, _, _ = pair("full", "cpu")
    tokens, targets = lm_batch(1, "cpu")
    seen = []
    for model in (plain, recomputed):
        obs = _Casts()
        previous = observe.install(obs)
        try:
            with g8.fp8_autocast(recipe=RECIPES["delayed"]):
                out = model(tokens[0])
            lm_loss(out, targets[0]).backward()
        finally:
            observe.install(previous)
        seen.append(obs.seen)
    assert seen[1] == seen[0]


def test_forward_update_between_forward_and_backward():
    """Two microbatches forward in their own regions, then one backward: the second region's
    forward update changes the scales before the first microbatch's recompute, which must still
    cast with the scales of its forward."""
    recipe = RECIPES["delayed"]
    plain, recomputed, _, _ = pair("full", "cpu")
    tokens, targets = lm_batch(3, "cpu", 5)
    tokens[1] *= 0  # other amaxes in the second microbatch
    for model in (plain, recomputed):
        with g8.fp8_autocast(recipe=recipe):  # scales away from 1 first
            lm_loss(model(tokens[2]), targets[2]).backward()
    results = []
    for model in (plain, recomputed):
        losses = []
        for i in range(2):
            with g8.fp8_autocast(recipe=recipe):
                losses.append(lm_loss(model(tokens[i]), targets[i]))
        sum(losses).backward()
        results.append([p.grad.clone() for p in model.parameters()])
    for i, (g, w) in enumerate(zip(results[1], results[0], strict=True)):
        assert_bitwise_equal(g, w, f"grad {i}")


def _held_after_forward(mode: str) -> int:
    """Bytes a forward of one layer allocates and keeps for its backward (the output not
    counted)."""
    torch.manual_seed(0)
    layer = g8.TransformerLayer(64, 4, 256, max_seq_len=32, params_dtype=torch.bfloat16,
                                activation="swiglu", normalization="RMSNorm", bias=False,
                                recompute=mode)  # fmt: skip
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    with g8.fp8_autocast(recipe=RECIPES["delayed"]):
        layer(x).sum().backward()  # slots and weight casts exist before measuring
        with LiveBytes() as live:
            y = layer(x, is_first_microbatch=False)
            held = live.live - y.untyped_storage().nbytes()
    y.sum().backward()
    return held


def test_recompute_frees_activations():
    none, selective, full = (_held_after_forward(m) for m in ("none", "selective", "full"))
    assert full < selective < none, (none, selective, full)
    # full keeps only the layer's input (its caller's tensor) and the scales saved per module
    assert full <= 64, full


def test_recompute_mode_is_checked():
    with pytest.raises(ValueError, match="recompute must be one of"):
        g8.TransformerLayer(32, 2, 64, recompute="some")
    layer = RecomputeLM().blocks[0]
    with pytest.raises(ValueError, match="recompute must be one of"):
        layer.recompute = True
    assert layer.recompute == "none"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 attention is cuDNN's (a GPU)")
@pytest.mark.parametrize("recipe", [DPA, MHA], ids=["fp8_dpa", "fp8_mha"])
@pytest.mark.parametrize("mode", MODES)
def test_recompute_with_fp8_attention(mode, recipe):
    """FP8 attention's casts (RoPE fused into q, k, v; the output into the projection) replayed
    with the forward's scales: 2 steps x 2 microbatches, everything bit for bit."""
    plain, x = layer_and_input("cuda")
    recomputed = copy.deepcopy(plain)
    recomputed.recompute = mode
    x = x.requires_grad_()
    for step in range(2):
        for mb in range(2):
            results = []
            for model in (plain, recomputed):
                xi = (x * (mb + 1)).detach().requires_grad_()
                with g8.fp8_autocast(recipe=recipe):
                    y = model(xi, is_first_microbatch=mb == 0)
                y.float().square().mean().backward()
                results.append((y.detach(), xi.grad))
            what = f"step {step} mb {mb}"
            assert_bitwise_equal(results[1][0], results[0][0], f"{what}: output")
            assert_bitwise_equal(results[1][1], results[0][1], f"{what}: input grad")
        for (name, p), q in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
            assert_bitwise_equal(q.grad, p.grad, f"step {step}: grad {name}")
        for (name, s), (_, r) in zip(fp8_state(plain), fp8_state(recomputed), strict=True):
            assert_bitwise_equal(r, s, f"step {step}: {name}")


def test_nested_recompute():
    """graphfp8.recompute around layers that recompute themselves (full): the inner regions'
    forwards inside the outer one's recompute replay the same scales and record nothing."""
    recipe = RECIPES["delayed"]
    plain, recomputed, _, _ = pair("full", "cpu")
    tokens, targets = lm_batch(2, "cpu", 3)
    results, seen = [], []
    for model, wrap in ((plain, False), (recomputed, True)):
        obs = _Casts()
        previous = observe.install(obs)
        try:
            for i in range(2):
                with g8.fp8_autocast(recipe=recipe):
                    h = model.embed(tokens[i])
                    blocks = torch.nn.Sequential(*model.blocks)
                    h = g8.recompute(blocks, h) if wrap else blocks(h)
                    loss = lm_loss(model.head(h), targets[i])
                loss.backward()
        finally:
            observe.install(previous)
        seen.append(obs.seen)
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert seen[1] == seen[0], "every cast observed once"
    assert_bitwise_equal(results[1][0], results[0][0], "loss")
    for i, (g, w) in enumerate(zip(results[1][1], results[0][1], strict=True)):
        assert_bitwise_equal(g, w, f"grad {i}")
    for (name, s), (_, r) in zip(fp8_state(plain), fp8_state(recomputed), strict=True):
        assert_bitwise_equal(r, s, name)
