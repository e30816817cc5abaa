"""FP8 primary weights inside the graphs: training (3 steps x 3 microbatches, MasterWeights +
AdamW) graphed == eager bit for bit; the weight transpose is a captured node (never left to
warmup) that runs on each step's first microbatch only."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.modules import cache_weight_transposes
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import TinyLM, adamw, lm_batch, lm_loss
from tests.modules.common import H, Stack, T, fp8_state

RECIPES = {"delayed": g8.DelayedScaling(amax_history_len=4), "current": g8.Float8CurrentScaling()}


def _build(kind: str, device):
    with g8.fp8_model_init():
        if kind == "Linear":
            return g8.Linear(H, 2 * H, params_dtype=torch.bfloat16, device=device)
        if kind == "LayerNormMLP":
            return g8.LayerNormMLP(H, 2 * H, params_dtype=torch.bfloat16, device=device)
        return Stack(device=device)


def _fp8_weights(m) -> list[Float8Tensor]:
    return [p for p in m.parameters() if isinstance(p, Float8Tensor)]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _transposes_current(m) -> bool:
    return all(torch.equal(_u8(p._transpose), _u8(p._data.t())) for p in _fp8_weights(m))


def _graphed(model, recipe, device):
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    return g8.make_graphed_callables(model, (sample,), fp8_enabled=True, fp8_recipe=recipe,
                                     fp8_weight_caching=True)  # fmt: skip


def _compare(eager, graphed, what: str) -> None:
    for (name, pe), (_, pg) in zip(eager.named_parameters(), graphed.named_parameters(),
                                   strict=True):  # fmt: skip
        if isinstance(pe, Float8Tensor):
            assert_bitwise_equal(_u8(pg._data), _u8(pe._data), f"{what}: {name} data")
            assert_bitwise_equal(pg._scale_inv, pe._scale_inv, f"{what}: {name} scale_inv")
        else:
            assert_bitwise_equal(pg, pe, f"{what}: {name}")
        if pe.grad is not None:
            assert_bitwise_equal(pg.grad, pe.grad, f"{what}: {name} grad")
    for (name, se), (_, sg) in zip(fp8_state(eager), fp8_state(graphed), strict=True):
        assert_bitwise_equal(sg, se, f"{what}: {name}")


@pytest.mark.parametrize(
    "kind, scaling, cache_t",
    [(k, s, True) for k in ("Linear", "LayerNormMLP", "Stack") for s in sorted(RECIPES)]
    + [("LayerNormMLP", "delayed", False)],
)
def test_training_graphed_equals_eager(device, kind, scaling, cache_t):
    """cache_t=False: cache_weight_transposes(model, False), the backward transposes the FP8
    weight itself (no transpose cache kept)."""
    recipe = RECIPES[scaling]
    eager = _build(kind, device)
    cache_weight_transposes(eager, cache_t)
    model = copy.deepcopy(eager)
    graphed = _graphed(model, recipe, device)
    masters = {"e": g8.MasterWeights(eager), "g": g8.MasterWeights(model)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in masters.items()}
    for step in range(3):
        for mb in range(3):
            x = torch.randn(T, H, dtype=torch.bfloat16, device=device) * 10.0 ** (mb - 1)
            xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            with g8.fp8_autocast(recipe=recipe):
                ye = eager(xe, is_first_microbatch=mb == 0)
            yg = graphed(xg, is_first_microbatch=mb == 0)
            ye.float().square().sum().backward()
            yg.float().square().sum().backward()
            what = f"step {step} mb {mb}"
            assert_bitwise_equal(yg, ye, f"{what}: output")
            assert_bitwise_equal(xg.grad, xe.grad, f"{what}: dgrad")
            _compare(eager, model, what)
            if cache_t:
                assert _transposes_current(model), f"{what}: stale transpose in the graphed model"
            else:
                assert all(p._transpose is None for p in _fp8_weights(model))
        for k in ("e", "g"):
            masters[k].step(opts[k])
            masters[k].zero_grad()
        for me, mg in zip(masters["e"].masters, masters["g"].masters, strict=True):
            assert_bitwise_equal(mg, me, f"step {step}: master")
        _compare(eager, model, f"after step {step}")


def test_transpose_is_a_captured_node_run_on_first_microbatches_only(device):
    """Warmup leaves the transpose cache valid, yet the capture records the transpose (the bug
    TransformerEngine hit: a cache filled in warmup, a kernel never captured). It runs on every
    first microbatch (after each write-back) and does nothing on the others."""
    model = _build("Linear", device)
    graphed = _graphed(model, RECIPES["delayed"], device)
    ops = graphed.captured_ops()["forward"]
    assert ops.count("graphfp8::fp8_transpose") == 1  # the weight's transpose
    assert ops.count("graphfp8::cast_transpose") == 1  # the input's cast; the weight is not cast
    w = model.weight
    masters = g8.MasterWeights(model)
    opt = torch.optim.SGD(masters.parameters(), lr=1.0)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    for step in range(3):
        _u8(w._transpose).fill_(0x11)  # poison: only the captured transpose can repair it
        graphed(x, is_first_microbatch=True).sum().backward()
        assert _transposes_current(model), f"step {step}: transpose not rebuilt in the graph"
        _u8(w._transpose).fill_(0x22)  # a later microbatch must leave it alone
        graphed(x, is_first_microbatch=False).sum().backward()
        assert bool((_u8(w._transpose) == 0x22).all()), f"step {step}: transpose ran again"
        before = w._data.clone()
        masters.step(opt)
        masters.zero_grad()
        assert not torch.equal(_u8(w._data), _u8(before)), f"step {step}: weight unchanged"


def test_microbatch_graph_of_a_language_model_equals_eager(device):
    """TinyLM (embedding, FP8 TransformerLayer, head) with FP8 primary weights: each microbatch
    one graph (make_graphed_microbatch), MasterWeights.step eagerly; equal to the eager loop."""
    n = 3
    with g8.fp8_model_init():
        eager = TinyLM(device)
    model = copy.deepcopy(eager)
    recipe = RECIPES["delayed"]
    mb = g8.make_graphed_microbatch(model, lm_loss, tuple(t[0] for t in lm_batch(1, device, 99)),
                                    n, fp8_enabled=True, fp8_recipe=recipe,
                                    fp8_weight_caching=True, num_warmup_iters=1)  # fmt: skip
    masters = {"e": g8.MasterWeights(eager), "g": g8.MasterWeights(model)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in masters.items()}
    for step in range(3):
        tokens, targets = lm_batch(n, device, step)
        for i in range(n):
            with g8.fp8_autocast(recipe=recipe):
                out = eager(tokens[i], is_first_microbatch=i == 0)
            loss_e = lm_loss(out, targets[i]) / n
            loss_e.backward()
            loss_g = mb((tokens[i], targets[i]), is_first_microbatch=i == 0)
            assert_bitwise_equal(loss_g, loss_e.detach(), f"step {step} mb {i}: loss")
        _compare(eager, model, f"step {step}")
        for k in ("e", "g"):
            masters[k].step(opts[k])
            masters[k].zero_grad()
    with pytest.raises(ValueError, match="needs master_weights"):
        g8.make_graphed_step(model, lm_loss, adamw(masters["g"].parameters(), device),
                             lm_batch(n, device, 0), n, fp8_enabled=True)  # fmt: skip


@pytest.mark.parametrize("scaling", sorted(RECIPES))
def test_step_graph_with_master_weights_equals_eager(device, scaling):
    """The whole step (3 microbatches, clipping, capturable AdamW on the fp32 masters, the cast
    back into FP8) as one graph, equal to the eager loop bit for bit for 3 steps."""
    n, recipe = 3, RECIPES[scaling]
    with g8.fp8_model_init():
        eager = TinyLM(device)
    model = copy.deepcopy(eager)
    masters = {"e": g8.MasterWeights(eager), "g": g8.MasterWeights(model)}
    opts = {k: adamw(m.parameters(), device) for k, m in masters.items()}
    step = g8.make_graphed_step(model, lm_loss, opts["g"], lm_batch(n, device, 99), n,
                                fp8_enabled=True, fp8_recipe=recipe, max_grad_norm=0.5,
                                num_warmup_iters=1, master_weights=masters["g"])  # fmt: skip
    for me, mg in zip(masters["e"].masters, masters["g"].masters, strict=True):
        assert_bitwise_equal(mg, me, "master after capture")  # warmup undone
    # One transpose node per weight, in microbatch 0: microbatches 1..n-1 reuse it and record
    # none (weight_cache.step_casts).
    assert step.captured_ops().count("graphfp8::fp8_transpose") == len(_fp8_weights(model))
    for s in range(3):
        tokens, targets = lm_batch(n, device, s)
        total = torch.zeros((), device=device)
        for i in range(n):
            with g8.fp8_autocast(recipe=recipe):
                loss = lm_loss(eager(tokens[i], is_first_microbatch=i == 0), targets[i]) / n
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        masters["e"].step(opts["e"])
        masters["e"].zero_grad()
        assert_bitwise_equal(step((tokens, targets)), total, f"step {s}: loss")
        for me, mg in zip(masters["e"].masters, masters["g"].masters, strict=True):
            assert_bitwise_equal(mg, me, f"step {s}: master")
        _compare(eager, model, f"step {s}")
