"""TransformerLayer with its QKV projection fused with RoPE (kernel switch ROPE_CAST_BWD,
modules/_qkv_rope.py) trains bit for bit like the unfused path (RopeQKVParts' backward, then the
projection's cast): outputs, input gradients, weights, gradients, scales and amax histories after
3 steps of 2 microbatches, under delayed and current scaling, eagerly and graphed; and the fused
path really runs (no RoPE backward pass, one fused cast per layer and microbatch)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8 import ops
from graphfp8.ops.switches import kernel_switch
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.modules.common import build, input_shape

RECIPES = {"delayed": g8.DelayedScaling(), "current": g8.Float8CurrentScaling()}
KINDS = ["TransformerLayer", "LlamaLayer", "RMSNormTransformerLayer"]


def _counting(monkeypatch, calls: dict) -> None:
    """Counts the calls of the fused cast and of the RoPE backward it replaces."""
    for name in ("rope_cast_transpose", "rope_fp8_backward"):
        fn = getattr(ops, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(ops, name, counted)


def _train(model, recipe, on: bool, device, graphed=False, steps=3, mbs=2, shape=None):
    gen = torch.Generator().manual_seed(5)

    def randn(like):
        return torch.randn(like.shape, generator=gen).to(like.dtype).to(device)

    sample = torch.zeros(shape or input_shape(model), dtype=torch.bfloat16, device=device)
    seen = []
    with kernel_switch("ROPE_CAST_BWD", on):
        call = model
        if graphed:
            call = g8.make_graphed_callables(model, (sample.clone().requires_grad_(),),
                                             fp8_enabled=True, fp8_recipe=recipe)  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(steps):
            for mb in range(mbs):
                x = (randn(sample) * 10.0**mb).requires_grad_()
                if graphed:
                    y = call(x)
                else:
                    with g8.fp8_autocast(recipe=recipe):
                        y = call(x)
                (y.float() * randn(y) * 10.0 ** (1 - mb)).sum().backward()
                seen += [y.detach().clone(), x.grad]
            opt.step()
            opt.zero_grad(set_to_none=False)
    return seen


def _compare(got, want, old, new, what):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"{what}: tensor {i}")
    compare_models(old, new, what)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("kind", KINDS)
def test_switch_on_trains_like_switch_off(device, kind, recipe, monkeypatch):
    old = build(kind, device=device)
    new = copy.deepcopy(old)
    want = _train(old, RECIPES[recipe], False, device)
    calls = {}
    _counting(monkeypatch, calls)
    got = _train(new, RECIPES[recipe], True, device)
    assert calls == {"rope_cast_transpose": 6}, calls  # 3 steps x 2 microbatches, one layer
    _compare(got, want, old, new, f"{kind} {recipe}")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_switch_on_graphed_equals_switch_off_eager(device, recipe):
    old = build("TransformerLayer", device=device)
    new = copy.deepcopy(old)
    want = _train(old, RECIPES[recipe], False, device)
    got = _train(new, RECIPES[recipe], True, device, graphed=True)
    _compare(got, want, old, new, f"graphed {recipe}")


def test_switch_off_takes_the_rope_backward(monkeypatch):
    """The default path is untouched: the RoPE backward, no fused cast."""
    calls = {}
    _counting(monkeypatch, calls)
    _train(build("TransformerLayer"), RECIPES["delayed"], False, "cpu", steps=1, mbs=1)
    assert calls == {"rope_fp8_backward": 1}, calls


@pytest.mark.parametrize("case", ["frozen_weight", "selective", "no_grad"])
def test_other_settings_keep_the_unfused_path(case, monkeypatch):
    """Where the fused Function does not apply the layer runs as with the switch off."""
    layer = build("TransformerLayer")
    if case == "frozen_weight":
        layer.qkv.weight.requires_grad_(False)
    if case == "selective":
        layer.recompute = "selective"
    calls = {}
    _counting(monkeypatch, calls)
    x = torch.randn(input_shape(layer), dtype=torch.bfloat16, requires_grad=case != "no_grad")
    with kernel_switch("ROPE_CAST_BWD", True), g8.fp8_autocast():
        with torch.set_grad_enabled(case != "no_grad"):
            y = layer(x)
    if case != "no_grad":
        y.float().sum().backward()
    assert "rope_cast_transpose" not in calls


class _Chain(torch.nn.Module):
    """Two layers handing the second residual add on (training/model.py's Blocks): the second
    layer's QKV projection takes the residual inside its norm."""

    def __init__(self, device):
        super().__init__()
        self.layers = torch.nn.ModuleList([build("LlamaLayer", device=device) for _ in range(2)])

    def forward(self, x):
        h, y = self.layers[0](x, defer_residual=True)
        return self.layers[1](h, residual=y)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_chained_layers_with_deferred_residual(device, recipe, monkeypatch):
    old = _Chain(device)
    new = copy.deepcopy(old)
    shape = input_shape(old.layers[0])
    want = _train(old, RECIPES[recipe], False, device, shape=shape)
    calls = {}
    _counting(monkeypatch, calls)
    got = _train(new, RECIPES[recipe], True, device, shape=shape)
    assert calls == {"rope_cast_transpose": 12}, calls  # two layers
    _compare(got, want, old, new, f"chain {recipe}")


def test_numerics_observer_sees_the_same_gradient():
    """FP8Stats' rows (graphfp8.numerics) are the same with the switch on: the observer of the
    QKV gradient cast gets the gradient the fused kernel cast, rebuilt only when observed."""
    from graphfp8.numerics import FP8Stats  # noqa: PLC0415

    rows, base = [], build("TransformerLayer")
    for on in (False, True):
        layer = copy.deepcopy(base)
        gen = torch.Generator().manual_seed(3)
        with FP8Stats(layer) as stats, kernel_switch("ROPE_CAST_BWD", on):
            stats.enable(True)
            for mb in range(2):
                x = torch.randn(input_shape(layer), generator=gen).bfloat16().requires_grad_()
                with g8.fp8_autocast():
                    y = layer(x)
                (y.float() * 10.0 ** (mb - 1)).square().sum().backward()
                stats.collect(0, mb)
            rows.append(stats.rows())
    assert any(r["role"] == "grad_output" for r in rows[0])
    assert rows[1] == rows[0]
