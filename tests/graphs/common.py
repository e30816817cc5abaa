"""An eager model and its graphed copy trained side by side, compared bit for bit."""

from __future__ import annotations

import copy

import torch
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, build, fp8_state, input_shape


class QKV(nn.Module):
    """Three FP8 projections of three inputs, mixed (self-attention's sample: one tensor thrice)."""

    def __init__(self, device):
        super().__init__()
        self.q, self.k, self.v = (g8.Linear(H, H, params_dtype=torch.bfloat16, device=device)
                                  for _ in range(3))  # fmt: skip

    def forward(self, q, k, v, is_first_microbatch=None):
        kw = dict(is_first_microbatch=is_first_microbatch)
        return self.q(q, **kw) * self.k(k, **kw).sigmoid() + self.v(v, **kw)


def compare_models(eager, graphed, what: str) -> None:
    for (name, pe), (_, pg) in zip(
        eager.named_parameters(), graphed.named_parameters(), strict=True
    ):
        assert_bitwise_equal(pg, pe, f"{what}: weight {name}")
        if pe.grad is None:
            assert pg.grad is None, f"{what}: grad {name} should be None"
        else:
            assert_bitwise_equal(pg.grad, pe.grad, f"{what}: grad {name}")
    for (name, se), (_, sg) in zip(fp8_state(eager), fp8_state(graphed), strict=True):
        assert_bitwise_equal(sg, se, f"{what}: {name}")


def backward_and_compare(ye, yg, xe, xg, what: str, grad: str = "dgrad") -> None:
    """Backpropagates one random dy (like ye) through the eager output ye and the other output
    yg (graphed, compiled), then checks both outputs and both input gradients bit for bit."""
    dy = torch.randn_like(ye)
    (ye.float() * dy).sum().backward()
    (yg.float() * dy).sum().backward()
    assert_bitwise_equal(yg, ye, f"{what}: output")
    assert_bitwise_equal(xg.grad, xe.grad, f"{what}: {grad}")


def snapshot(m) -> list[torch.Tensor]:
    """Copies of m's FP8 state, parameters and gradients: what a refused call must not change."""
    grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    return (
        [t.clone() for _, t in fp8_state(m)] + [p.detach().clone() for p in m.parameters()] + grads
    )


def assert_unchanged(m, before: list[torch.Tensor], what: str) -> None:
    """m's snapshot() is `before`, bit for bit."""
    now = snapshot(m)
    assert len(now) == len(before), f"{what}: gradients appeared or went"
    for a, b in zip(now, before, strict=True):
        assert_bitwise_equal(a, b, what)


def train_side_by_side(kind, recipe, caching, device, steps=3, mbs=3, set_to_none=True):
    """Trains `kind` eagerly and through make_graphed_callables on the same data, asserting
    equality after every microbatch and every optimizer step. Returns the two models."""
    eager = build(kind, device=device)
    sample = torch.randn(input_shape(eager), dtype=torch.bfloat16, device=device)
    eager, graphed_model, _ = train_pair(eager, sample, recipe, caching, steps, mbs, set_to_none)
    return eager, graphed_model


def train_pair(eager, sample, recipe, caching, steps=3, mbs=3, set_to_none=True):
    """train_side_by_side for a given model and sample input (the data: randn like `sample`).
    Returns (eager model, graphed model, graphed callable)."""
    graphed_model = copy.deepcopy(eager)
    sample = sample.detach().clone().requires_grad_()
    graphed = g8.make_graphed_callables(graphed_model, (sample,), fp8_enabled=True,
                                        fp8_recipe=recipe, fp8_weight_caching=caching)  # fmt: skip
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_g = torch.optim.AdamW(graphed_model.parameters(), lr=1e-2)
    for step in range(steps):
        for mb in range(mbs):
            first = (mb == 0) if caching else None
            x = torch.randn_like(sample.detach()) * 10.0 ** (mb - 1)
            xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            with g8.fp8_autocast(recipe=recipe):
                ye = eager(xe, is_first_microbatch=first)
            yg = graphed(xg, is_first_microbatch=first)
            dy = torch.randn_like(ye) * 10.0 ** (1 - mb)
            loss_e, loss_g = (ye.float() * dy).sum(), (yg.float() * dy).sum()
            loss_e.backward()
            loss_g.backward()
            what = f"step {step} mb {mb}"
            assert_bitwise_equal(yg, ye, f"{what}: output")
            assert_bitwise_equal(loss_g, loss_e, f"{what}: loss")
            assert_bitwise_equal(xg.grad, xe.grad, f"{what}: dgrad")
            compare_models(eager, graphed_model, what)
        for opt in (opt_e, opt_g):
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        compare_models(eager, graphed_model, f"after step {step}")
    return eager, graphed_model, graphed


class Layers(torch.nn.Module):
    """The layers a graph set captures, one callable each (they are run in order)."""

    def __init__(self, kinds, device):
        super().__init__()
        self.layers = torch.nn.ModuleList(_layer(k, device) for k in kinds)


def _layer(kind: str, device) -> torch.nn.Module:
    if kind == "Linear":  # H -> H, so that layers chain
        return g8.Linear(H, H, params_dtype=torch.bfloat16, device=device)
    return build(kind, device=device)


def train_layers(kinds, flags, recipes, caching, device, steps=2, mbs=2):
    """Trains the layers eagerly (layer j inside fp8_autocast(enabled=flags[j],
    recipe=recipes[j])) and graphed with fp8_enabled=flags, fp8_recipe=recipes; asserts every
    output, gradient, weight and FP8 state equal. Returns (eager outputs, eager layers)."""
    eager = Layers(kinds, device)
    model = copy.deepcopy(eager)
    shape = input_shape(eager.layers[0])
    samples = tuple((torch.randn(shape, dtype=torch.bfloat16, device=device,
                                 requires_grad=True),) for _ in kinds)  # fmt: skip
    graphed = g8.make_graphed_callables(tuple(model.layers), samples, fp8_enabled=flags,
                                        fp8_recipe=recipes, fp8_weight_caching=caching)  # fmt: skip
    opt_e, opt_g = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model))
    outputs = []
    for step in range(steps):
        for mb in range(mbs):
            first = (mb == 0) if caching else None
            x = torch.randn(shape, dtype=torch.bfloat16, device=device) * 10.0 ** (mb - 1)
            xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            ye, yg = xe, xg
            for layer, g, flag, recipe in zip(eager.layers, graphed, flags, recipes, strict=True):
                with g8.fp8_autocast(enabled=flag, recipe=recipe):
                    ye = layer(ye, is_first_microbatch=first)
                yg = g(yg, is_first_microbatch=first)
            what = f"{flags} {recipes} step {step} mb {mb}"
            backward_and_compare(ye, yg, xe, xg, what)
            compare_models(eager, model, what)
            outputs.append(ye.detach())
        for opt in (opt_e, opt_g):
            opt.step()
            opt.zero_grad()
    return outputs, eager
