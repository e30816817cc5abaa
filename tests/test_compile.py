"""torch.compile through and around graphfp8 layers (docs/architecture.md, "torch.compile"):
compiled == eager bit for bit (outputs, every gradient, FP8 scales and histories), and no compile
path - tracing, a failed compile, a recompile - leaves a module different from eager use.

Compiling is slow on the CPU (inductor builds C++): the tests of numerics compile with inductor,
the tests of dynamo's behaviour (guards, graph breaks, errors) with backends that build nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.modules.common import build, fp8_state, input_shape

RECIPE = g8.DelayedScaling(amax_history_len=4)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch: no cache entry of another test's backend or guards."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(model: nn.Module, device: str, scale: float = 1.0):
    """The same bf16 input twice, each its own leaf that requires grad."""
    x = torch.randn(input_shape(model), dtype=torch.bfloat16, device=device) * scale
    return x.clone().requires_grad_(), x.clone().requires_grad_()


def _microbatch(eager_call, compiled_call, eager, compiled, device, first, what: str) -> None:
    """One forward + backward of each under fp8_autocast, then everything compared."""
    xe, xc = _inputs(eager, device)
    with g8.fp8_autocast(recipe=RECIPE):
        ye = eager_call(xe, first)
    with g8.fp8_autocast(recipe=RECIPE):
        yc = compiled_call(xc, first)
    dy = torch.randn_like(ye)
    (ye.float() * dy).sum().backward()
    (yc.float() * dy).sum().backward()
    assert_bitwise_equal(yc, ye, f"{what}: output")
    assert_bitwise_equal(xc.grad, xe.grad, f"{what}: dgrad")
    compare_models(eager, compiled, what)


def _train_side_by_side(eager, compiled, compiled_call, device, steps=3, mbs=2) -> None:
    """`steps` AdamW steps of `mbs` microbatches each (is_first_microbatch on the first), the
    compiled call against the eager module, compared after every microbatch and step."""
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    eager_call = lambda x, first: eager(x, is_first_microbatch=first)  # noqa: E731
    for step in range(steps):
        for mb in range(mbs):
            _microbatch(eager_call, compiled_call, eager, compiled, device, mb == 0,
                        f"step {step} mb {mb}")  # fmt: skip
        for opt in (opt_e, opt_c):
            opt.step()
            opt.zero_grad(set_to_none=True)
        compare_models(eager, compiled, f"after step {step}")


def _eager_use_matches(model, twin, device, what: str) -> None:
    """The module used eagerly afterwards (a step of two microbatches) equals its twin."""
    call = lambda m: lambda x, first: m(x, is_first_microbatch=first)  # noqa: E731
    for mb in range(2):
        _microbatch(call(twin), call(model), twin, model, device, mb == 0, f"{what}, mb {mb}")


# The example ---------------------------------------------------------------------------


def test_compiled_call_with_autocast_inside_then_eager(device):
    """Issue 18: compiling a function that enters fp8_autocast and calls a LayerNormMLP ran, its
    backward failed (the FP8 weight workspace had lost its transpose buffer) and so did every
    eager use afterwards. Now: compiled == eager, and eager use afterwards == eager."""
    model = build("LayerNormMLP", device=device)
    twin = copy.deepcopy(model)

    def step(m, x, first):
        with g8.fp8_autocast(recipe=RECIPE):
            return m(x, is_first_microbatch=first)

    compiled = torch.compile(step)
    for mb in range(3):
        xe, xc = _inputs(model, device)
        ye, yc = step(twin, xe, mb == 0), compiled(model, xc, mb == 0)
        ye.float().sum().backward()
        yc.float().sum().backward()
        assert_bitwise_equal(yc, ye, f"mb {mb}: output")
        assert_bitwise_equal(xc.grad, xe.grad, f"mb {mb}: dgrad")
        compare_models(twin, model, f"mb {mb}")
    _eager_use_matches(model, twin, device, "eager after compiled")
