"""FP8 attention's eval calls are frozen like the GEMMs' (issue 39, item 2; docs/fp8.md,
"Evaluation"): an eval-mode call of a layer with FP8 attention (fp8_dpa, fp8_mha) leaves every FP8
history and scale - the attention's slots included - as it found them, so training with an eval
pass per step is bit for bit training without it, eager and graphed. All failed before: the
attention took its slots as a training call does, recording its Q, K, V, S, O amaxes and running
the forward arena's scale update (which moved the GEMMs' scales too). On the CPU through the
emulation; the CUDA cases run cuDNN's FP8 attention."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.modules.attention_common import DPA, MHA, layer_and_input, shape_for
from tests.modules.common import fp8_state

RECIPES = {"fp8_dpa": DPA, "fp8_mha": MHA}


def _eval_input(x: torch.Tensor) -> torch.Tensor:
    """50x the training data, from a generator of its own (the training data stays the same): an
    amax it recorded would change the next scales."""
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(x.shape, generator=gen) * 50).to(x.dtype).to(x.device)


def _states(m) -> list[torch.Tensor]:
    return [t.clone() for _, t in fp8_state(m)]


def _assert_states(m, before, what: str) -> None:
    for (name, t), b in zip(fp8_state(m), before, strict=True):
        assert_bitwise_equal(t, b, f"{what}: {name}")


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_an_eval_call_leaves_the_attention_state_alone(device, recipe, grad):
    """TransformerLayer (fused QKV, RoPE in the casts): an eval call under no_grad, or with grad
    and a backward through it, changes no history and no scale."""
    m, x = layer_and_input(device)
    for mb in range(2):
        with g8.fp8_autocast(recipe=recipe):
            y = m(x.clone().requires_grad_(), is_first_microbatch=mb == 0)
        y.float().square().mean().backward()
    assert m.core_attention.fp8_meta is not None, "the attention ran in FP8"
    before = _states(m)
    m.eval()
    with torch.set_grad_enabled(grad), g8.fp8_autocast(recipe=recipe):
        xe = _eval_input(x).requires_grad_(grad)
        y = m(xe)
    if grad:
        y.float().square().mean().backward()
    _assert_states(m, before, "after an eval call")


def test_an_eval_call_of_dot_product_attention_is_frozen(device):
    """The separate q, k, v entry point (forward) too."""
    b, s, h, d = shape_for(device)
    layer = g8.DotProductAttention(h, d, device=device)
    qkv = [torch.randn(b, s, h, d, dtype=torch.bfloat16, device=device) for _ in "qkv"]
    for _ in range(2):
        with g8.fp8_autocast(recipe=DPA):
            y = layer(*(t.clone().requires_grad_() for t in qkv))
        y.float().square().mean().backward()
    before = _states(layer)
    layer.eval()
    with torch.no_grad(), g8.fp8_autocast(recipe=DPA):
        layer(*(_eval_input(t) for t in qkv))
    _assert_states(layer, before, "after an eval call")


def _train(model, graphed: bool, eval_pass: bool, recipe, sample, steps=2, mbs=2):
    """Trains `model` (eagerly or through make_graphed_callables) with an eval pass after
    microbatch 0 of each step when `eval_pass`. Returns the training outputs and the eval ones."""
    call = model
    if graphed:
        call = g8.make_graphed_callables(model, (sample.clone().requires_grad_(),),
                                         fp8_enabled=True, fp8_recipe=recipe,
                                         fp8_weight_caching=True, num_warmup_iters=1)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outs, evals = [], []
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for mb in range(mbs):
            x = torch.randn(sample.shape, generator=gen).to(sample).requires_grad_()
            with g8.fp8_autocast(recipe=recipe):
                y = call(x, is_first_microbatch=mb == 0)
            outs.append(y.detach().clone())
            y.float().square().sum().backward()
            if eval_pass and mb == 0:
                model.eval()
                with torch.no_grad(), g8.fp8_autocast(recipe=recipe):
                    evals.append(call(_eval_input(sample)))
                model.train()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, evals


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_training_with_eval_passes_equals_training_without(device, recipe):
    """Eager with eval passes == eager without; graphed with eval passes (the eager fallback)
    == graphed without == eager; the graphed eval outputs == the eager ones."""
    base, sample = layer_and_input(device)
    runs = {}
    for graphed in (False, True):
        for eval_pass in (False, True):
            m = copy.deepcopy(base)
            runs[graphed, eval_pass] = (m, *_train(m, graphed, eval_pass, recipe, sample))
    ref, ref_outs, _ = runs[False, False]
    for key, (m, outs, _) in runs.items():
        what = f"graphed={key[0]}, eval passes={key[1]}"
        for i, (a, b) in enumerate(zip(outs, ref_outs, strict=True)):
            assert_bitwise_equal(a, b, f"{what}: training microbatch {i}")
        compare_models(ref, m, what)
    for i, (g, e) in enumerate(zip(runs[True, True][2], runs[False, True][2], strict=True)):
        assert_bitwise_equal(g, e, f"graphed eval pass {i}")


def test_explicit_positions_under_fp8_attention_run_in_eval_mode_and_are_refused_in_training():
    """position_ids (generate()'s path, modules/_explicit_attention.py): in eval mode the layer
    runs it in high precision, every FP8 state as it was; in training mode it raises, naming
    eval mode, before any state changes."""
    m, x = layer_and_input("cpu")
    with g8.fp8_autocast(recipe=DPA):
        m(x.clone().requires_grad_()).float().square().mean().backward()
    before = _states(m)
    pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    with g8.fp8_autocast(recipe=DPA), pytest.raises(ValueError, match="model.eval()"):
        m(x, position_ids=pos)
    _assert_states(m, before, "after the refused training call")
    m.eval()
    with torch.no_grad(), g8.fp8_autocast(recipe=DPA):
        y = m(_eval_input(x), position_ids=pos)
    assert torch.isfinite(y).all()
    _assert_states(m, before, "after an eval call with position_ids")
