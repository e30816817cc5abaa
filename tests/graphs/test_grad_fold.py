"""Parameter gradients of graphed callables fold into `.grad` inside the backward graph: no static
per-parameter gradient buffers, and `.grad` bit for bit what eager AccumulateGrad gives - after
zero_grad(set_to_none=True) (signed zeros and NaN included), with `.grad` kept, with a `.grad`
the user replaced, and for a parameter shared by two callables; the -0.0 fill before the first
microbatch in either form (GRAPHFP8_GRAD_FILL_ONE_PASS off / on), or, under
GRAPHFP8_GRAD_FOLD_COPY_FIRST, no fill of the large buffers and a fold that copies on the first
microbatch."""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.graphs import grads
from graphfp8.graphs.backends import new_graph, tapes_allocate_as_cuda
from graphfp8.memory import memory_report
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import train_side_by_side
from tests.helpers import HAS_CUDA

SHAPE = (16, 32)


class Scale(nn.Module):
    """y = x * p + b: the gradient of p is dy * x element by element (no reduction), so it can be
    -0.0 or NaN exactly where the test puts them."""

    def __init__(self, dtype):
        super().__init__()
        self.p = nn.Parameter(torch.randn(SHAPE, dtype=dtype))
        self.b = nn.Parameter(torch.randn(SHAPE[1], dtype=dtype))

    def forward(self, x):
        return x * self.p + self.b


def _special_input(dtype) -> torch.Tensor:
    """Random values with -1 where dy is 0 (dp = 0 * -1 = -0.0) and a NaN."""
    x = torch.randn(SHAPE, dtype=dtype)
    x[0, :4] = -1.0
    x[1, 0] = math.nan
    return x


def _special_grad(dtype) -> torch.Tensor:
    dy = torch.randn(SHAPE, dtype=dtype)
    dy[0, :4] = 0.0
    return dy


def _check(eager, graphed_model, what):
    for (name, pe), (_, pg) in zip(
        eager.named_parameters(), graphed_model.named_parameters(), strict=True
    ):
        if pe.grad is None:
            assert pg.grad is None, f"{what}: {name}.grad should be None"
        else:
            assert_bitwise_equal(pg.grad, pe.grad, f"{what}: {name}.grad")


@pytest.fixture(params=["at once", "at the end"])
def fold_at_once(request, monkeypatch):
    """Folds every gradient as autograd produces it, or every one in the graph's final add."""
    monkeypatch.setattr(grads, "FOLD_AT_ONCE", 1 if request.param == "at once" else 1 << 30)


@pytest.fixture(params=["zero-neg", "one-pass"])
def grad_fill(request, monkeypatch):
    """The -0.0 fill as zero + negate (the default) or one fill_ per large buffer."""
    monkeypatch.setenv("GRAPHFP8_GRAD_FILL_ONE_PASS", "1" if request.param == "one-pass" else "0")
    return request.param


@pytest.fixture(params=["add", "copy-first"])
def copy_first(request, monkeypatch):
    """Every fold adds into a filled buffer (the default) or the first fold copies."""
    on = request.param == "copy-first"
    monkeypatch.setenv("GRAPHFP8_GRAD_FOLD_COPY_FIRST", "1" if on else "0")
    return on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_fold_bit_for_bit_in_every_grad_state(dtype, fold_at_once, grad_fill, copy_first):
    eager = Scale(dtype)
    model = copy.deepcopy(eager)
    sample = torch.randn(SHAPE, dtype=dtype)
    graphed = g8.make_graphed_callables(model, (sample,), num_warmup_iters=1)
    states = ["none", "kept", "kept", "replaced", "none", "mixed", "kept"]
    for i, state in enumerate(states):
        if state == "none":
            for m in (eager, model):
                m.zero_grad(set_to_none=True)
        elif state == "replaced":  # the user hands both a .grad of their own
            own = torch.randn(SHAPE, dtype=dtype)
            eager.p.grad, model.p.grad = own.clone(), own.clone()
        elif state == "mixed":  # p's grad dropped, b's kept
            eager.p.grad = model.p.grad = None
        replaced = model.p.grad
        x, dy = _special_input(dtype), _special_grad(dtype)
        eager(x).backward(dy)
        graphed(x).backward(dy)
        _check(eager, model, f"microbatch {i} ({state})")
        if state == "replaced":
            assert model.p.grad is replaced, "a .grad the user set must stay that tensor"
    assert torch.isnan(model.p.grad[1, 0]) and torch.signbit(model.p.grad[0, 0]) is not None


def test_a_parameter_shared_by_two_callables_accumulates_both(fold_at_once, copy_first):
    """Each callable's backward graph adds its own contribution, the later callable's first: the
    eager reference runs the two backwards separately in that order (autograd on one graph would
    sum the two contributions first, rounding differently)."""
    torch.manual_seed(0)
    first, second = Scale(torch.float32), Scale(torch.float32)
    second.p = first.p  # tied
    eager = nn.ModuleList([first, second])
    model = copy.deepcopy(eager)
    sample = torch.randn(SHAPE, requires_grad=True)
    g1, g2 = g8.make_graphed_callables(
        (model[0], model[1]), ((sample,), (sample.detach().clone().requires_grad_(),)),
        num_warmup_iters=1,
    )  # fmt: skip
    for step in range(2):
        for _ in range(2):
            x = _special_input(torch.float32).requires_grad_()
            dy = _special_grad(torch.float32)
            y1 = eager[0](x)
            y1_in = y1.detach().requires_grad_()
            eager[1](y1_in).backward(dy)
            y1.backward(y1_in.grad)
            g2(g1(x.detach().clone().requires_grad_())).backward(dy)
            _check(eager, model, f"step {step}")
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)


def test_no_static_parameter_gradients_outlive_the_graph():
    m = g8.LayerNormMLP(64, 256, params_dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    graphed = g8.make_graphed_callables(m, (x,), fp8_enabled=True, fp8_weight_caching=True,
                                        num_warmup_iters=1)  # fmt: skip
    graphed(x, is_first_microbatch=True).sum().backward()
    report = memory_report(m, graphed=[graphed], other={"x": x, "x.grad": x.grad})
    assert "graph param grads" not in report.bytes, report.format()
    assert all(p.grad is p._graphfp8_grad for p in m.parameters())


def test_transformer_layer_graphed_equals_eager_with_every_grad_folded_at_once(
    monkeypatch, grad_fill, copy_first
):
    """The layers' own tests fold small gradients at the end; here every one as produced (and,
    with grad_fill one-pass, every buffer filled by its own fill_; with copy_first, every one
    folded by grad_fold_ and none filled)."""
    monkeypatch.setattr(grads, "FOLD_AT_ONCE", 1)
    recipe = g8.DelayedScaling(amax_history_len=4)
    train_side_by_side("TransformerLayer", recipe, True, "cpu", steps=2, mbs=2)


def _captured_fill(dtype, device) -> tuple:
    """fill_minus_zero of two large and two small buffers captured, the buffers then overwritten
    with random values, NaN, -inf and +0.0, and the graph replayed: (graph, buffers)."""
    n = grads.FOLD_AT_ONCE
    shapes = [(n,), (7,), (3, n), (5, 3)]
    buffers = [torch.randn(s, dtype=dtype, device=device) for s in shapes]
    graph = new_graph(torch.device(device))
    with graph.capture():
        grads.fill_minus_zero(buffers)
    for b in buffers:
        b.copy_(torch.randn(b.shape, dtype=dtype, device=device))
        b.view(-1)[:3] = torch.tensor([math.nan, -math.inf, 0.0], dtype=dtype)
    graph.replay()
    for i, b in enumerate(buffers):
        assert torch.equal(b, torch.zeros_like(b)) and bool(torch.signbit(b).all()), f"buffer {i}"
    return graph, buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fill_writes_minus_zero_in_the_kernels_it_names(dtype, grad_fill):
    """Every element -0.0 after the captured fill replays over NaN, inf and signed values; one
    pass records one fill_ per buffer of FOLD_AT_ONCE elements or more and the two multi-tensor
    kernels for the small ones only, the default the two multi-tensor kernels over all."""
    graph, _ = _captured_fill(dtype, "cpu")
    one_pass = ["aten::fill_", "aten::fill_", "aten::_foreach_zero_", "aten::_foreach_neg_"]
    expected = one_pass if grad_fill == "one-pass" else one_pass[2:]
    assert graph.kernels() == expected


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fill_in_a_cuda_graph_writes_minus_zero(dtype, grad_fill):
    _captured_fill(dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_transformer_layer_graphed_equals_eager_on_cuda(monkeypatch, grad_fill, copy_first):
    """Every gradient folded as produced, so that under one-pass every buffer is one fill_ and
    under copy-first every one reads the flag."""
    monkeypatch.setattr(grads, "FOLD_AT_ONCE", 1)
    train_side_by_side("TransformerLayer", g8.DelayedScaling(amax_history_len=4), True, "cuda",
                       steps=2, mbs=2)  # fmt: skip


def test_copy_first_folds_with_the_flag_and_fills_only_the_rest(monkeypatch):
    """Under GRAD_FOLD_COPY_FIRST the backward graph folds each large gradient with grad_fold_
    and clears the flag after it, the small ones with the multi-tensor add; the reset graph sets
    the flag and fills only the small buffers with -0.0."""
    monkeypatch.setenv("GRAPHFP8_GRAD_FOLD_COPY_FIRST", "1")
    monkeypatch.setattr(grads, "FOLD_AT_ONCE", SHAPE[0] * SHAPE[1])  # p at once, b at the end
    graphed = g8.make_graphed_callables(Scale(torch.float32), (torch.randn(SHAPE),),
                                        num_warmup_iters=1)  # fmt: skip
    backward = graphed.captured_kernels()["backward"]
    assert backward.count("graphfp8::grad_fold_") == 1
    assert backward.count("aten::_foreach_add_") == 1
    assert backward.index("aten::zero_") > backward.index("graphfp8::grad_fold_")
    reset = graphed.graphed_runner.pair.accumulator.reset_graph.kernels()
    assert reset == ["aten::fill_", "aten::_foreach_zero_", "aten::_foreach_neg_"]


def test_the_copy_first_flag_lives_as_long_as_the_graphs(monkeypatch):
    """A CUDA graph holds the flag's address, not the tensor: the graphed callable must keep the
    flag allocated after the capture. Under tapes_allocate_as_cuda the CPU tape, like a CUDA
    graph, holds nothing it recorded. (Session 9's H200 failure: the flag was freed with the
    GradFold after capture, its memory reused, and later replays copied instead of adding.)"""
    monkeypatch.setenv("GRAPHFP8_GRAD_FOLD_COPY_FIRST", "1")
    monkeypatch.setattr(grads, "FOLD_AT_ONCE", 1)
    flags = []
    init = grads.GradFold.__init__

    def recording_init(self, params, device):
        init(self, params, device)
        flags.append(weakref.ref(self.first))

    monkeypatch.setattr(grads.GradFold, "__init__", recording_init)
    with tapes_allocate_as_cuda():
        graphed = g8.make_graphed_callables(Scale(torch.float32), (torch.randn(SHAPE),),
                                            num_warmup_iters=1)  # fmt: skip
    gc.collect()
    assert flags and all(f() is not None for f in flags)
    del graphed
    gc.collect()
    assert all(f() is None for f in flags)  # and freed with the graphs
