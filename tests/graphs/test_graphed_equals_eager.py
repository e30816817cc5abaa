"""Graphed == eager, bit for bit, after every microbatch and step: outputs, losses, grads,
weights, scales and amax histories (the CPU tape in CI, CUDA graphs with `make test-gpu`)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models, train_side_by_side
from tests.modules.common import H, Stack, T

KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "Stack"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("fmt", [g8.Format.HYBRID, g8.Format.E4M3])
@pytest.mark.parametrize("length", [1, 16])
@pytest.mark.parametrize("margin", [0, 1])
def test_graphed_equals_eager(device, kind, caching, fmt, length, margin):
    recipe = g8.DelayedScaling(fp8_format=fmt, amax_history_len=length, margin=margin)
    train_side_by_side(kind, recipe, caching, device)


@pytest.mark.parametrize(
    "kind", ["RMSNormLinear", "Chain", "RMSNormMLP", "RMSNormTransformerLayer", "SwiGLUMLP",
             "GeGLUMLP", "LlamaLayer"]
)  # fmt: skip
def test_graphed_equals_eager_rmsnorm_and_fp8_chain(device, kind):
    train_side_by_side(kind, g8.DelayedScaling(amax_history_len=4), True, device)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("fmt", [g8.Format.HYBRID, g8.Format.E4M3])
def test_graphed_equals_eager_transformer_layer(device, caching, fmt):
    train_side_by_side("TransformerLayer", g8.DelayedScaling(fp8_format=fmt, amax_history_len=4),
                       caching, device)  # fmt: skip


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grad_accumulation_with_either_zero_grad(device, set_to_none):
    train_side_by_side("LayerNormMLP", g8.DelayedScaling(amax_history_len=4), True, device,
                       steps=3, mbs=4, set_to_none=set_to_none)  # fmt: skip


def test_tuple_of_callables_updates_once_per_microbatch(device):
    """Each layer of a Stack graphed as its own callable (torch layers included): the forward
    update runs in the first callable's forward graph, the backward update in the last backward
    graph, once per microbatch - so the result equals the eager Stack."""
    recipe = g8.DelayedScaling(amax_history_len=4)
    eager = Stack(device=device)
    g = copy.deepcopy(eager)
    kw = dict(dtype=torch.bfloat16, device=device, requires_grad=True)
    samples = ((torch.randn(T, H, **kw),), (torch.randn(T, 2 * H, **kw),),
               (torch.randn(T, 2 * H, **kw),), (torch.randn(T, H, **kw),),
               (torch.randn(T, H, **kw),))  # fmt: skip
    layers = g8.make_graphed_callables((g.qkv, g.act, g.proj, g.norm, g.mlp), samples,
                                       fp8_enabled=True, fp8_recipe=recipe,
                                       fp8_weight_caching=True)  # fmt: skip
    fwd_ops = [layer.captured_ops()["forward"] for layer in layers]
    bwd_ops = [layer.captured_ops()["backward"] for layer in layers]
    assert [ops.count("graphfp8::scale_update") for ops in fwd_ops] == [1, 0, 0, 0, 0]
    assert [ops.count("graphfp8::scale_update") for ops in bwd_ops] == [1, 0, 0, 0, 0]
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    for step in range(3):
        for mb in range(3):
            first = mb == 0
            x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
            xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            with g8.fp8_autocast(recipe=recipe):
                ye = eager(xe, is_first_microbatch=first)
            h = layers[0](xg, is_first_microbatch=first)
            h = layers[2](layers[1](h), is_first_microbatch=first)
            yg = layers[4](layers[3](h), is_first_microbatch=first)
            assert_bitwise_equal(yg, ye, "output")
            ye.float().square().sum().backward()
            yg.float().square().sum().backward()
            assert_bitwise_equal(xg.grad, xe.grad, "dgrad")
            compare_models(eager, g, f"step {step} mb {mb}")
        opt_e.step()
        opt_g.step()
        opt_e.zero_grad()
        opt_g.zero_grad()


def test_plain_function_callable(device):
    """A plain function (no parameters of its own) that closes over a module: the module's
    parameters are found and get their gradients, as eagerly; FP8 modules reached only through
    it initialise during warmup, and the warmup leaves no trace."""
    recipe = g8.DelayedScaling(amax_history_len=4)
    eager = g8.LayerNormMLP(H, 2 * H, params_dtype=torch.bfloat16, device=device)
    inner = copy.deepcopy(eager)
    fn = lambda x: inner(x) * 2.0  # noqa: E731
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    graphed = g8.make_graphed_callables(fn, (sample,), fp8_enabled=True, fp8_recipe=recipe)
    assert inner.fp8_meta is not None
    for _ in range(3):
        x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
        with g8.fp8_autocast(recipe=recipe):
            ye = eager(x) * 2.0
        yg = graphed(x)
        assert yg.requires_grad, "the closed-over parameters require grad"
        assert_bitwise_equal(yg, ye)
        ye.float().square().sum().backward()
        yg.float().square().sum().backward()
        compare_models(eager, inner, "plain function")
