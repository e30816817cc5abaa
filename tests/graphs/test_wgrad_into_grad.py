"""GRAPHFP8_WGRAD_INTO_GRAD: the FP8 weight-gradient GEMM writes the parameter's .grad itself
(beta 0 where .grad is None or a step starts, 1 after), eagerly and inside the layer and
microbatch graphs and the step graph's static buffers, which equal eager bit for bit in every
.grad state; the captured graphs hold no fill and no add for those weights; the eager backwards
that do not store into .grad keep today's path, and FSDP2's captures refuse the switch."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8 import into_grad
from graphfp8.graphs import grads
from graphfp8.graphs.backends import tapes_allocate_as_cuda
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import train_side_by_side
from tests.graphs.step_common import (
    RECIPE,
    TinyLM,
    adamw,
    lm_batch,
    lm_loss,
    tiny_lm_step_graph_equals_eager,
)
from tests.helpers import DEVICES, HAS_CUDA
from tests.modules.common import H, fp8_state

# The GEMM weights of each layer kind (tests/modules/common.py's build).
WEIGHTS = {"Linear": 1, "LayerNormLinear": 1, "LayerNormMLP": 2, "TransformerLayer": 4,
           "LlamaLayer": 4}  # fmt: skip


@pytest.fixture
def gemm_calls(monkeypatch):
    """GRAPHFP8_WGRAD_INTO_GRAD on; counts the GEMMs that wrote a .grad (eager calls and
    captures; a replay runs the captured op without Python)."""
    monkeypatch.setenv("GRAPHFP8_WGRAD_INTO_GRAD", "1")
    calls = []
    gemm = into_grad._gemm

    def counted(*args):
        calls.append(args[4].shape)
        gemm(*args)

    monkeypatch.setattr(into_grad, "_gemm", counted)
    return calls


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_layer_graphs_equal_eager(kind, set_to_none, gemm_calls):
    """Two steps of two microbatches: outputs, input and parameter gradients, weights, FP8 state
    bit for bit after every microbatch and step (tests/graphs/common.py), the eager backward
    taking the GEMM path for every weight."""
    train_side_by_side(kind, RECIPE, True, "cpu", steps=2, mbs=2, set_to_none=set_to_none)
    captured = WEIGHTS[kind]
    assert len(gemm_calls) == captured + 2 * 2 * WEIGHTS[kind]


def test_every_grad_folded_at_once(monkeypatch, gemm_calls):
    """The other gradients folded as produced, between the GEMMs' writes."""
    monkeypatch.setattr(grads, "FOLD_AT_ONCE", 1)
    train_side_by_side("TransformerLayer", RECIPE, True, "cpu", steps=2, mbs=2)


def _linear_pair():
    torch.manual_seed(0)
    eager = g8.Linear(H, 2 * H, params_dtype=torch.bfloat16)
    model = copy.deepcopy(eager)
    sample = torch.randn(16, H, dtype=torch.bfloat16)
    graphed = g8.make_graphed_callables(model, (sample,), fp8_enabled=True, fp8_recipe=RECIPE,
                                        num_warmup_iters=1)  # fmt: skip
    return eager, model, graphed


def test_every_grad_state_equals_eager(gemm_calls):
    """.grad None, kept, replaced by the user's tensor (which stays that tensor), one of two
    dropped: the graph's beta flag, the -0.0 fill of a dropped buffer (beta 1 onto -0.0 is the
    product's bits) and the copies of a replaced .grad give eager's bits."""
    eager, model, graphed = _linear_pair()
    for i, state in enumerate(["none", "kept", "replaced", "kept", "mixed", "none", "kept"]):
        if state == "none":
            eager.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
        elif state == "replaced":
            own = torch.randn(2 * H, H, dtype=torch.bfloat16)
            eager.weight.grad, model.weight.grad = own.clone(), own.clone()
        elif state == "mixed":  # the weight's .grad dropped, the bias's kept
            eager.weight.grad = model.weight.grad = None
        replaced = model.weight.grad
        x = torch.randn(16, H, dtype=torch.bfloat16) * 10.0 ** (i % 3 - 1)
        dy = torch.randn(16, 2 * H, dtype=torch.bfloat16)
        with g8.fp8_autocast(recipe=RECIPE):
            eager(x).backward(dy)
        graphed(x).backward(dy)
        for (name, pe), (_, pg) in zip(eager.named_parameters(), model.named_parameters(),
                                       strict=True):  # fmt: skip
            assert_bitwise_equal(pg.grad, pe.grad, f"microbatch {i} ({state}): {name}.grad")
        if state == "replaced":
            assert model.weight.grad is replaced
    assert len(gemm_calls) == 1 + 7


def test_the_graphs_hold_no_fill_and_no_add_for_the_weights(monkeypatch):
    """Every gradient folded as produced, every buffer filled by its own fill_ (so the kernel
    lists count buffers): with the switch the backward graph writes fc1's and fc2's .grad in
    their GEMMs (no add) and sets beta back to 1 after them, the reset graph fills the other
    buffers only and sets beta to 0."""
    monkeypatch.setattr(grads, "FOLD_AT_ONCE", 1)
    monkeypatch.setenv("GRAPHFP8_GRAD_FILL_ONE_PASS", "1")
    kernels = {}
    for on in ("0", "1"):
        monkeypatch.setenv("GRAPHFP8_WGRAD_INTO_GRAD", on)
        m = g8.LayerNormMLP(H, 4 * H, params_dtype=torch.bfloat16)
        x = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
        graphed = g8.make_graphed_callables(m, (x,), fp8_enabled=True, fp8_recipe=RECIPE,
                                            num_warmup_iters=1)  # fmt: skip
        reset = graphed.graphed_runner.pair.accumulator.reset_graph.kernels()
        kernels[on] = graphed.captured_kernels()["backward"], reset
    params = 6  # norm weight and bias, fc1 weight and bias, fc2 weight and bias
    (bwd_off, reset_off), (bwd_on, reset_on) = kernels["0"], kernels["1"]
    assert "graphfp8::fp8_gemm_into" not in bwd_off and reset_off == ["aten::fill_"] * params
    assert bwd_off.count("aten::add_") - bwd_on.count("aten::add_") == 2
    assert bwd_on.count("graphfp8::fp8_gemm_into") == 2
    assert bwd_on.count("aten::copy_") == bwd_off.count("aten::copy_") + 1
    gemms = [i for i, k in enumerate(bwd_on) if k == "graphfp8::fp8_gemm_into"]
    assert len(bwd_on) - 1 - bwd_on[::-1].index("aten::copy_") > gemms[-1]  # beta back to 1
    assert reset_on == ["aten::copy_"] + ["aten::fill_"] * (params - 2)  # beta 0, then fills


def test_the_beta_scalars_live_as_long_as_the_graphs(monkeypatch, gemm_calls):
    """A CUDA graph holds the (alpha, beta) pairs' addresses, not the tensors: the graphed
    callable keeps them allocated after the capture, and frees them with the graphs. Under
    tapes_allocate_as_cuda the CPU tape, like a CUDA graph, holds nothing it recorded (the copy-
    first flag's H200 failure of session 9: freed with the GradFold, its memory reused)."""
    scalars = []
    init = grads.GradFold.__init__

    def recording_init(self, params, device):
        init(self, params, device)
        if self.alpha_beta is not None:
            scalars.extend(weakref.ref(t) for t in (self.alpha_beta, self.ones, self.beta_zero))

    monkeypatch.setattr(grads.GradFold, "__init__", recording_init)
    with tapes_allocate_as_cuda():
        m = g8.LayerNormMLP(H, 4 * H, params_dtype=torch.bfloat16)
        graphed = g8.make_graphed_callables(m, (torch.randn(16, H, dtype=torch.bfloat16),),
                                            fp8_enabled=True, fp8_recipe=RECIPE,
                                            num_warmup_iters=1)  # fmt: skip
    gc.collect()
    assert scalars and all(t() is not None for t in scalars)
    del graphed, m  # the module is the graphed callable
    gc.collect()
    assert all(t() is None for t in scalars)


@pytest.mark.parametrize("device", DEVICES)
def test_graphed_microbatch_equals_eager(device, gemm_calls):
    """make_graphed_microbatch of a tiny LM (FP8 TransformerLayer and head): its capture folds
    the other gradients and the GEMMs write theirs; two steps of two microbatches bit for bit."""
    n = 2
    torch.manual_seed(0)
    eager = TinyLM(device)
    model = copy.deepcopy(eager)
    tokens, targets = lm_batch(1, device, 99)
    graphed = g8.make_graphed_microbatch(model, lm_loss, (tokens[0], targets[0]), n,
                                         fp8_enabled=True, fp8_recipe=RECIPE,
                                         fp8_weight_caching=True, num_warmup_iters=1)  # fmt: skip
    calls = len(gemm_calls)
    for step in range(2):
        batch = lm_batch(n, device, step)
        for i in range(n):
            with g8.fp8_autocast(recipe=RECIPE):
                out = eager(batch[0][i], is_first_microbatch=i == 0)
            (lm_loss(out, batch[1][i]) / n).backward()
            graphed((batch[0][i], batch[1][i]), is_first_microbatch=i == 0)
            what = f"step {step} microbatch {i}"
            for (name, pe), (_, pg) in zip(eager.named_parameters(), model.named_parameters(),
                                           strict=True):  # fmt: skip
                assert_bitwise_equal(pg.grad, pe.grad, f"{what}: {name}.grad")
            for (name, se), (_, sg) in zip(fp8_state(eager), fp8_state(model), strict=True):
                assert_bitwise_equal(sg, se, f"{what}: {name}")
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
    assert len(gemm_calls) - calls == 2 * n * 5  # qkv, proj, fc1, fc2, head: eager


def test_step_graph_equals_eager(gemm_calls):
    """make_graphed_step of the tiny LM, 2 steps of 2 microbatches: the GEMMs write the static
    .grad buffers (beta 0 on the first microbatch, 1 on the second), the other gradients copied
    then added; loss, gradients, weights, optimizer and FP8 state bit for bit with eager."""
    tiny_lm_step_graph_equals_eager("cpu", RECIPE, n=2, steps=2)
    assert len(gemm_calls) == 2 * 5 + 2 * 2 * 5  # the capture's two microbatches, then eager


def test_the_step_graph_writes_its_buffers_in_the_gemms(monkeypatch):
    """The captured step with the switch: five GEMMs per microbatch write .grad, the copy and
    the add of the other gradients remain (one multi-tensor kernel each)."""
    kernels = {}
    for on in ("0", "1"):
        monkeypatch.setenv("GRAPHFP8_WGRAD_INTO_GRAD", on)
        model = TinyLM("cpu")
        step = g8.make_graphed_step(model, lm_loss, adamw(model.parameters(), "cpu"),
                                    lm_batch(2, "cpu"), 2, fp8_enabled=True, fp8_recipe=RECIPE,
                                    num_warmup_iters=1)  # fmt: skip
        kernels[on] = step.captured_kernels()
    assert "graphfp8::fp8_gemm_into" not in kernels["0"]
    assert kernels["1"].count("graphfp8::fp8_gemm_into") == 2 * 5
    for op in ("aten::_foreach_copy_", "aten::_foreach_add_"):
        assert kernels["1"].count(op) == kernels["0"].count(op), op


def test_fsdp2_captures_refuse_the_switch(monkeypatch):
    monkeypatch.setenv("GRAPHFP8_WGRAD_INTO_GRAD", "1")
    with pytest.raises(RuntimeError, match="WGRAD_INTO_GRAD=1 is not supported for FSDP2"):
        grads.check_into_grad("make_graphed_callables", "FSDP2 layers")
    monkeypatch.setenv("GRAPHFP8_WGRAD_INTO_GRAD", "0")
    grads.check_into_grad("make_graphed_callables", "FSDP2 layers")


def _fp8_linear():
    torch.manual_seed(0)
    m = g8.Linear(H, 2 * H, params_dtype=torch.bfloat16)
    x = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
    return m, x


def _out(m, x):
    with g8.fp8_autocast(recipe=RECIPE):
        return m(x).float().square().sum()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_eager_backwards_that_store_no_grad_keep_todays_path(gemm_calls):
    """torch.autograd.grad over the weight returns its gradient, backward(inputs=[x]) leaves
    .grad alone, a tensor hook sees the gradient, create_graph adds out of place, a weight with
    another grad_dtype gets its gradient cast by AccumulateGrad: no GEMM writes a .grad."""
    m, x = _fp8_linear()
    (dw,) = torch.autograd.grad(_out(m, x), [m.weight])
    assert dw.shape == m.weight.shape and m.weight.grad is None
    _out(m, x).backward(inputs=[x])
    assert m.weight.grad is None and x.grad is not None
    seen = []
    handle = m.weight.register_hook(lambda g: seen.append(g))
    _out(m, x).backward()
    handle.remove()
    assert len(seen) == 1 and seen[0] is not None
    assert_bitwise_equal(m.weight.grad, seen[0], "hooked .grad")
    m.weight.grad = None
    _out(m, x).backward(create_graph=True)
    assert m.weight.grad is not None
    m.weight.grad = None
    m.weight.grad_dtype = torch.float32  # AccumulateGrad casts the bf16 gradient
    _out(m, x).backward()
    assert m.weight.grad.dtype == torch.float32 and m.weight.grad.any()
    assert gemm_calls == []


def test_eager_backward_writes_grad_in_the_gemm(gemm_calls):
    """loss.backward(): the first microbatch allocates .grad (beta 0), the second writes into
    that tensor (beta 1)."""
    m, x = _fp8_linear()
    _out(m, x).backward()
    first = m.weight.grad
    assert first is not None and first.dtype == torch.bfloat16
    _out(m, x).backward()
    assert m.weight.grad is first
    assert gemm_calls == [m.weight.shape] * 2


def test_the_switch_off_takes_todays_path(monkeypatch):
    monkeypatch.setenv("GRAPHFP8_WGRAD_INTO_GRAD", "0")
    calls = []
    monkeypatch.setattr(into_grad, "_gemm", lambda *a: calls.append(a))
    m, x = _fp8_linear()
    _out(m, x).backward()
    assert calls == [] and m.weight.grad is not None


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["LayerNormMLP", "LlamaLayer"])
def test_layer_graphs_equal_eager_on_cuda(kind, gemm_calls):
    train_side_by_side(kind, RECIPE, True, "cuda", steps=2, mbs=2)
    train_side_by_side(kind, RECIPE, True, "cuda", steps=2, mbs=2, set_to_none=False)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_transformer_layer_every_grad_folded_at_once_on_cuda(monkeypatch, gemm_calls):
    monkeypatch.setattr(grads, "FOLD_AT_ONCE", 1)
    train_side_by_side("TransformerLayer", RECIPE, True, "cuda", steps=2, mbs=2)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_step_graph_equals_eager_on_cuda(gemm_calls):
    tiny_lm_step_graph_equals_eager("cuda", RECIPE, n=2, steps=2)
    assert gemm_calls
