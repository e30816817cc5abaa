"""Calls of the graph entry points that eager autograd refuses or that train where the caller asked
for no training (the graphfix misuse round, notes/MISUSE.md): each raises a clear error before
anything runs, or equals eager bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import assert_unchanged, compare_models, snapshot
from tests.graphs.step_common import adamw, compare_step, compare_training_state, eager_step
from tests.modules.common import H, T, build

RECIPE = g8.DelayedScaling(amax_history_len=4)
FP8 = dict(fp8_enabled=True, fp8_recipe=RECIPE, fp8_weight_caching=True)


def _x(device, requires_grad=True, dtype=torch.bfloat16):
    return torch.randn(T, H, dtype=dtype, device=device, requires_grad=requires_grad)


def _mse(y, t):
    return F.mse_loss(y.float(), t.float())


class SigmoidHead(nn.Module):
    """A torch Linear and a sigmoid, whose backward reads its output (eager autograd saves it)."""

    def __init__(self, device):
        super().__init__()
        self.lin = nn.Linear(H, H, device=device)

    def forward(self, x):
        return torch.sigmoid(self.lin(x))


# Writes into what the captured backward reads -----------------------------------------------------


def test_an_output_the_backward_reads_written_in_place_raises_before_the_backward(device):
    """Eager autograd refuses the backward ('modified by an inplace operation'); the graph read
    the changed buffer and gave other gradients."""
    model = SigmoidHead(device)
    g = g8.make_graphed_callables(model, (_x(device, dtype=torch.float32),))
    y = g(_x(device, dtype=torch.float32))
    y.mul_(2)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"output 0 of the call was modified by an in-place op"):
        y.sum().backward()
    assert_unchanged(model, before, "the backward did not run")


def test_an_output_the_backward_does_not_read_may_be_written_in_place(device):
    """`out += residual` on the output of a layer whose backward does not read it: eager's
    gradients."""
    eager = nn.Linear(H, H, device=device)
    model = copy.deepcopy(eager)
    g = g8.make_graphed_callables(model, (_x(device, dtype=torch.float32),))
    for mb in range(2):
        x = _x(device, requires_grad=False, dtype=torch.float32)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yg = eager(xe), g(xg)
        ye.add_(x)
        yg.add_(x)
        ye.square().sum().backward()
        yg.square().sum().backward()
        assert_bitwise_equal(yg, ye, f"mb {mb}: output")
        assert_bitwise_equal(xg.grad, xe.grad, f"mb {mb}: input grad")
        compare_models(eager, model, f"mb {mb}")


def test_the_static_input_written_in_place_before_the_backward_raises(device):
    """The static input buffer passed back (no copy) and refilled before the backward of a layer
    that saved its input (torch's Linear): eager autograd refuses that backward, the graph read
    the new values."""
    model = nn.Linear(H, H, device=device)
    g = g8.make_graphed_callables(model, (_x(device, dtype=torch.float32),))
    static = g.graphed_runner.pair.static_inputs[0]
    y = g(static)
    with torch.no_grad():
        static.normal_()
    with pytest.raises(RuntimeError, match=r"argument 0 of the call was modified by an in-place"):
        y.sum().backward()


def test_the_sample_is_the_callers_and_free_after_capture(device):
    """Issue 39: the sample tensor was the static input buffer, overwritten by every later call
    (the microbatch and step graphs' samples too). Now a copy is: the sample keeps its values,
    and writing it after a call that passed it changes nothing the backward reads."""
    model = nn.Linear(H, H, device=device)
    sample = _x(device, dtype=torch.float32).requires_grad_()
    kept = sample.detach().clone()
    g = g8.make_graphed_callables(model, (sample,))
    g(_x(device, dtype=torch.float32).requires_grad_())
    assert_bitwise_equal(sample.detach(), kept, "the sample after a call")
    model.zero_grad()
    y = g(sample)
    with torch.no_grad():
        sample.normal_()
    y.sum().backward()
    written = model.weight.grad.clone()
    # Against the same graph on an untouched copy, not eager: on the H200 this float32 GEMM's
    # graphed and eager gradients differed (2026-12-01; cuBLAS's choice under capture, a guess).
    model.zero_grad()
    g(kept.clone().requires_grad_()).sum().backward()
    assert_bitwise_equal(written, model.weight.grad, "weight grad")


# Activation checkpointing around a graphed callable ---------------------------------------------


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_around_a_graphed_callable_raises(device, reentrant):
    """The recompute replayed the forward graph a second time, FP8 scale update included (the
    reentrant form gave other gradients than the same calls without checkpoint, the other form a
    schedule error that said to run a backward first)."""
    model = build("LayerNormMLP", device=device)
    g = g8.make_graphed_callables(model, (_x(device),), **FP8)
    y = checkpoint(lambda t: g(t, is_first_microbatch=True).float().sigmoid(), _x(device),
                   use_reentrant=reentrant)  # fmt: skip
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"called inside a backward pass \(the recompute of"):
        y.sum().backward()
    assert_unchanged(model, before, "the graphed backward did not run")


# Grad mode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_graphed_callables_under_no_grad_equal_eager(device, mode):
    eager = build("LayerNormMLP", device=device)
    model = copy.deepcopy(eager)
    g = g8.make_graphed_callables(model, (_x(device),), **FP8)
    for mb in range(2):
        x = _x(device)
        with mode():
            with g8.fp8_autocast(recipe=RECIPE):
                want = eager(x, is_first_microbatch=mb == 0)
            got = g(x, is_first_microbatch=mb == 0)
        assert not got.requires_grad
        assert_bitwise_equal(got, want, f"mb {mb}")
        compare_models(eager, model, f"mb {mb}")


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("entry", ["microbatch", "step"])
def test_microbatch_and_step_graphs_refuse_no_grad(device, entry, mode):
    """Eager code under no_grad cannot run their backward; the graphs trained anyway (.grad,
    FP8 scales, the optimizer step) where the caller wanted an evaluation."""
    model = build("LayerNormMLP", device=device)
    x = torch.randn(2, T, H, dtype=torch.bfloat16, device=device)
    if entry == "step":
        g = g8.make_graphed_step(model, _mse, adamw(model.parameters(), device), (x, x.clone()),
                                 2, fp8_enabled=True, fp8_recipe=RECIPE)  # fmt: skip
        batch = (x, x.clone())
    else:
        g = g8.make_graphed_microbatch(model, _mse, (x[0], x[1]), fp8_enabled=True,
                                       fp8_recipe=RECIPE)  # fmt: skip
        batch = (x[0], x[1])
    g(batch)
    before = snapshot(model)
    with mode(), pytest.raises(RuntimeError, match=r"called under torch.no_grad\(\) or torch.inf"):
        g(batch)
    assert_unchanged(model, before, "nothing ran")


def test_a_microbatch_batch_that_requires_grad_raises(device):
    """Eager code gives such an input a .grad; the graph computes the parameters' gradients
    only (the capture refused such a sample, a call took it silently)."""
    model = build("LayerNormMLP", device=device)
    g = g8.make_graphed_microbatch(model, _mse, (_x(device, False), _x(device, False)))
    before = snapshot(model)
    with pytest.raises(ValueError, match="batch tensor 0 requires grad"):
        g((_x(device), _x(device, False)))
    assert_unchanged(model, before, "nothing ran")


# The step graph's .grad and optimizer ----------------------------------------------------------


@pytest.mark.parametrize("how", ["set_to_none", "replaced"])
def test_the_step_puts_its_gradients_back_in_grad(device, how):
    """After zero_grad(set_to_none=True) or a .grad replaced by another tensor between steps,
    .grad after the next step is that step's gradient (a replaced .grad kept its stale values)."""
    model = build("LayerNormMLP", device=device)
    x = torch.randn(2, T, H, dtype=torch.bfloat16, device=device)
    step = g8.make_graphed_step(model, _mse, adamw(model.parameters(), device), (x, x.clone()), 2)
    step((x, torch.randn_like(x)))
    for p in model.parameters():
        p.grad = None if how == "set_to_none" else torch.zeros_like(p)
    step((x, torch.randn_like(x)))
    for p, g in zip(step.params, step.grads, strict=True):
        assert p.grad is g


def test_another_hyperparameter_than_the_learning_rate_says_to_recapture(device):
    model = build("Linear", device=device)
    x = torch.randn(2, T, H, dtype=torch.bfloat16, device=device)
    opt = adamw(model.parameters(), device)
    step = g8.make_graphed_step(model, _mse, opt, (x, torch.randn(2, T, 2 * H, device=device)), 2)
    opt.param_groups[0]["weight_decay"] = 0.0
    with pytest.raises(RuntimeError, match=r"'weight_decay' changed .* capture the step again"):
        step((x, torch.randn(2, T, 2 * H, device=device)))


# Captures the entry points cannot hold ----------------------------------------------------------


@pytest.mark.parametrize("entry", ["callables", "microbatch", "step"])
def test_a_capture_under_no_grad_that_needs_a_backward_says_so(device, entry):
    """make_graphed_callables failed with a bare StopIteration, the others named the loss."""
    model = build("LayerNormMLP", device=device)
    x = torch.randn(2, T, H, dtype=torch.bfloat16, device=device)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"captured under torch.no_grad\(\)"):
        if entry == "callables":
            g8.make_graphed_callables(model, (x[0].clone().requires_grad_(),), **FP8)
        elif entry == "microbatch":
            g8.make_graphed_microbatch(model, _mse, (x[0], x[1]))
        else:
            g8.make_graphed_step(model, _mse, adamw(model.parameters(), device), (x, x), 2)


def test_a_forward_only_capture_under_no_grad_equals_eager(device):
    eager = build("LayerNormMLP", device=device).requires_grad_(False)
    model = copy.deepcopy(eager)
    with torch.no_grad():
        g = g8.make_graphed_callables(model, (_x(device, False),), **FP8)
    for mb in range(2):
        x = _x(device, False)
        with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
            want = eager(x, is_first_microbatch=mb == 0)
        assert_bitwise_equal(g(x, is_first_microbatch=mb == 0), want, f"mb {mb}")


@pytest.mark.parametrize("entry", ["microbatch", "step"])
def test_a_model_holding_a_graphed_callable_is_refused(device, entry):
    """Its capture would record a replay inside another capture; the error came from the inner
    callable's input check, from the warmup."""
    inner = build("LayerNormMLP", device=device)
    g8.make_graphed_callables(inner, (_x(device),), **FP8)
    model = nn.Sequential(inner)
    x = torch.randn(2, T, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match=rf"make_graphed_{entry}: the model contains LayerNorm"):
        if entry == "microbatch":
            g8.make_graphed_microbatch(model, _mse, (x[0], x[1]))
        else:
            g8.make_graphed_step(model, _mse, adamw(model.parameters(), device), (x, x), 2)


@pytest.mark.parametrize("entry", ["microbatch", "step"])
def test_torch_compile_around_a_microbatch_or_step_call_is_one_opaque_call(entry):
    """As a graphed callable's: dynamo traced into the checks and the replay (warning about the
    graphfp8._C functions it cannot trace; fullgraph=True failed there); eager's bits."""
    eager = build("LayerNormMLP")
    model = copy.deepcopy(eager)
    x = torch.randn(2, T, H, dtype=torch.bfloat16)
    opt_e, opt_g = adamw(eager.parameters(), "cpu"), adamw(model.parameters(), "cpu")
    if entry == "step":
        g = g8.make_graphed_step(model, _mse, opt_g, (x, x.clone()), 2, **FP8)
    else:
        g = g8.make_graphed_microbatch(model, _mse, (x[0], x[1]), **FP8)
    batch = (torch.randn_like(x), torch.randn_like(x))
    given = batch if entry == "step" else (batch[0][0], batch[1][0])
    full = torch.compile(lambda b: g(b) * 1.0, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="without fullgraph=True"):  # nothing ran
        full(given)
    got = torch.compile(lambda b: g(b) * 1.0, backend="eager")(given)
    if entry == "step":
        compare_step(g, eager_step(eager, _mse, opt_e, batch, 2), "the step")
        compare_training_state(eager, model, opt_e, opt_g, "after the step")
        return
    with g8.fp8_autocast(recipe=RECIPE):
        out = eager(batch[0][0], is_first_microbatch=True)
    want = _mse(out, batch[1][0])
    want.backward()
    assert_bitwise_equal(got, want.detach(), "loss")
    compare_models(eager, model, "after the call")


@pytest.mark.parametrize("entry", ["microbatch", "step"])
def test_a_compiled_model_is_refused_as_by_make_graphed_callables(entry):
    """One rule for the three entry points (capture first, compile around); the microbatch and
    step graphs took a torch.compile'd model."""
    model = torch.compile(build("LayerNormMLP"), backend="eager")
    x = torch.randn(2, T, H, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=rf"make_graphed_{entry}: the model is a torch.compile'd"):
        if entry == "microbatch":
            g8.make_graphed_microbatch(model, _mse, (x[0], x[1]))
        else:
            g8.make_graphed_step(model, _mse, adamw(model.parameters(), "cpu"), (x, x), 2)
