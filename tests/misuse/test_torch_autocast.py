"""graphfp8 layers under torch.autocast (issue 25, row 10): like TransformerEngine, the autocast
dtype is the activation dtype. Under fp8_autocast a layer computes exactly as without
torch.autocast and returns its outputs in the autocast dtype (it returned its parameters'
dtype); inputs of the autocast dtype are taken (they raised). Eager and graphed alike."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import graphfp8 as g8
import graphfp8.te
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import CUDA_PARAM
from tests.modules.common import build, input_shape

RECIPE = g8.DelayedScaling(amax_history_len=4)
LAYERS = ["Linear", "LayerNormLinear", "LayerNormMLP", "RMSNormMLP"]
# Models that run torch ops between their graphfp8 layers (GELU, LayerNorm, attention, residual
# adds), which torch.autocast changes as it changes them anywhere.
MODELS = ["Stack", "Chain", "TransformerLayer"]


def _autocast(device):
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def _step(model, x, autocast, device):
    """One FP8 forward and backward; returns (output, input grad)."""
    x = x.detach().clone().requires_grad_()
    with _autocast(device) if autocast else contextlib.nullcontext():
        with g8.fp8_autocast(recipe=RECIPE):
            y = model(x, is_first_microbatch=True)
    if not autocast:
        y = y.to(torch.bfloat16)
    y.float().square().sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("kind", LAYERS)
def test_fp8_under_autocast_returns_its_dtype_and_computes_as_without(device, kind):
    base = build(kind, dtype=torch.float32, device=device)
    plain, auto = copy.deepcopy(base), copy.deepcopy(base)
    x = torch.randn(input_shape(base), device=device)
    for i in range(2):
        want, want_dx = _step(plain, x, False, device)
        got, got_dx = _step(auto, x, True, device)
        assert got.dtype == torch.bfloat16 and got_dx.dtype == torch.float32
        assert_bitwise_equal(got, want, f"step {i}: output")
        assert_bitwise_equal(got_dx, want_dx, f"step {i}: input grad")
    for (name, p), (_, q) in zip(plain.named_parameters(), auto.named_parameters(), strict=True):
        assert_bitwise_equal(q.grad, p.grad, f"grad {name}")


@pytest.mark.parametrize("kind", ["LayerNormMLP", "Stack"])
def test_a_backward_under_autocast_computes_as_outside(device, kind):
    """loss.backward() inside the torch.autocast region (the usual loop) gives the gradients of a
    backward outside it: the FP8 GEMMs are not recast (on the CPU, torch's FP8 emulation ran its
    fp32 matmul in bf16 under autocast)."""
    base = build(kind, dtype=torch.float32, device=device)
    x = torch.randn(input_shape(base), device=device)
    grads = []
    for inside in (False, True):
        m = copy.deepcopy(base)
        with _autocast(device):
            with g8.fp8_autocast(recipe=RECIPE):
                y = m(x, is_first_microbatch=True)
            loss = y.float().square().sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([p.grad for p in m.parameters()])
    for i, (a, b) in enumerate(zip(*grads, strict=True)):
        assert_bitwise_equal(b, a, f"grad {i}")


@pytest.mark.parametrize("kind", MODELS)
def test_models_under_autocast_return_its_dtype(device, kind):
    m = build(kind, dtype=torch.float32, device=device)
    got, dx = _step(m, torch.randn(input_shape(m), device=device), True, device)
    assert got.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


@pytest.mark.parametrize("kind", MODELS + ["te.TransformerLayer"])
def test_outside_fp8_models_return_the_autocast_dtype_too(device, kind):
    """Issue 39: without fp8_autocast a TransformerLayer's residual adds ran in its parameters'
    dtype and returned float32 under torch.autocast(bfloat16), where TransformerEngine's returns
    bfloat16 (and the FP8 forward does)."""
    if kind == "te.TransformerLayer":
        m = g8.te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                   device=device)  # fmt: skip
        x = torch.randn(32, 2, 64, device=device)
    else:
        m = build(kind, dtype=torch.float32, device=device)
        x = torch.randn(input_shape(m), device=device)
    with _autocast(device):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


@pytest.mark.parametrize("fp8", [False, True], ids=["torch", "fp8"])
def test_an_input_of_the_autocast_dtype_is_taken(device, fp8):
    """The output of an earlier autocast op (bf16) into fp32 layers: cast, as autocast casts an
    nn.Linear's input (a bf16 value is exact in fp32)."""
    m = build("LayerNormMLP", dtype=torch.float32, device=device)
    twin = copy.deepcopy(m)
    x = torch.randn(input_shape(m), device=device).to(torch.bfloat16)
    with _autocast(device), g8.fp8_autocast(enabled=fp8, recipe=RECIPE):
        y = m(x, is_first_microbatch=True)
    with g8.fp8_autocast(enabled=fp8, recipe=RECIPE):
        want = twin(x.float(), is_first_microbatch=True)
    assert y.dtype == torch.bfloat16
    if fp8:
        assert_bitwise_equal(y, want.to(torch.bfloat16))


GRAPH_DEVICES = ["cpu", CUDA_PARAM]


@pytest.mark.parametrize("device", GRAPH_DEVICES)
@pytest.mark.parametrize("kind", ["Linear", "Stack"])
def test_graphed_under_autocast_equals_eager_under_autocast(device, kind):
    """Captured under torch.autocast, replayed under it: the eager run's bits."""
    base = build(kind, dtype=torch.float32, device=device)
    eager, graphed_model = copy.deepcopy(base), copy.deepcopy(base)
    sample = torch.randn(input_shape(base), device=device, requires_grad=True)
    with _autocast(device):
        graphed = g8.make_graphed_callables(graphed_model, (sample,), fp8_enabled=True,
                                            fp8_recipe=RECIPE, fp8_weight_caching=True,
                                            num_warmup_iters=1)  # fmt: skip
    for i in range(2):
        x = torch.randn(input_shape(base), device=device)
        want, want_dx = _step(eager, x, True, device)
        xg = x.clone().requires_grad_()
        with _autocast(device):
            yg = graphed(xg, is_first_microbatch=True)
        yg.float().square().sum().backward()
        assert yg.dtype == torch.bfloat16
        assert_bitwise_equal(yg, want, f"step {i}: output")
        assert_bitwise_equal(xg.grad, want_dx, f"step {i}: input grad")
