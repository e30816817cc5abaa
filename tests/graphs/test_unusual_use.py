"""Unusual uses of the graphed entry points that must equal eager bit for bit or raise before
anything runs (issue 25's graph rows): one tensor as several inputs, overlapping inputs, a backward
that asks for a subset of the gradients, a replay in another training mode, a microbatch that
leaves a callable out, torch.compile(fullgraph=True) around a graphed callable."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import QKV, assert_unchanged, compare_models, snapshot
from tests.graphs.step_common import adamw
from tests.modules.common import H, T, build

RECIPE = g8.DelayedScaling(amax_history_len=4)
FP8 = dict(fp8_enabled=True, fp8_recipe=RECIPE, fp8_weight_caching=True)


def _x(device, requires_grad=True):
    return torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=requires_grad)


# Row 1: one tensor as several sample args; overlapping inputs ------------------------------------


def test_one_tensor_as_several_inputs_gets_its_gradient_summed_once(device):
    eager = QKV(device)
    model = copy.deepcopy(eager)
    s = _x(device)
    g = g8.make_graphed_callables(model, (s, s, s), **FP8)
    for mb in range(3):
        x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        with g8.fp8_autocast(recipe=RECIPE):
            ye = eager(xe, xe, xe, is_first_microbatch=mb == 0)
        yg = g(xg, xg, xg, is_first_microbatch=mb == 0)
        ye.float().square().sum().backward()
        yg.float().square().sum().backward()
        assert_bitwise_equal(yg, ye, f"mb {mb}: output")
        assert_bitwise_equal(xg.grad, xe.grad, f"mb {mb}: the input's gradient, summed once")
        compare_models(eager, model, f"mb {mb}")


def test_aliasing_other_than_captured_raises_before_running(device):
    model = QKV(device)
    s = _x(device)
    g = g8.make_graphed_callables(model, (s, s, s), **FP8)
    g(s, s, s, is_first_microbatch=True).float().sum().backward()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"captured with one tensor at arguments 0 and 1"):
        g(_x(device), _x(device), _x(device), is_first_microbatch=False)
    assert_unchanged(model, before, "nothing ran")
    other = QKV(device)
    g2 = g8.make_graphed_callables(other, (_x(device), _x(device), _x(device)), **FP8)
    x = _x(device)
    with pytest.raises(ValueError, match=r"arguments 0 and 1 are one tensor, but the graph was"):
        g2(x, x, x, is_first_microbatch=True)


def test_overlapping_sample_inputs_are_refused(device):
    base = torch.randn(T + 1, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"sample arguments \[0, 1\] are different tensors that"):
        g8.make_graphed_callables(QKV(device), (base[:T], base[1:], _x(device)))


def test_non_overlapping_views_of_one_tensor_equal_eager(device):
    eager = QKV(device)
    model = copy.deepcopy(eager)
    qkv = torch.randn(T, 3 * H, dtype=torch.bfloat16, device=device, requires_grad=True)
    g = g8.make_graphed_callables(model, tuple(qkv.chunk(3, dim=-1)), **FP8)
    for mb in range(2):
        x = torch.randn(T, 3 * H, dtype=torch.bfloat16, device=device)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        with g8.fp8_autocast(recipe=RECIPE):
            ye = eager(*xe.chunk(3, dim=-1), is_first_microbatch=mb == 0)
        yg = g(*xg.chunk(3, dim=-1), is_first_microbatch=mb == 0)
        ye.float().square().sum().backward()
        yg.float().square().sum().backward()
        assert_bitwise_equal(yg, ye, f"mb {mb}: output")
        assert_bitwise_equal(xg.grad, xe.grad, f"mb {mb}: the fused input's gradient")
        compare_models(eager, model, f"mb {mb}")


# Row 2: a backward that asks for a subset of the gradients ----------------------------------------


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
def test_a_backward_for_the_inputs_only_leaves_grad_alone(device, how):
    eager = build("LayerNormMLP", device=device)
    model = copy.deepcopy(eager)
    g = g8.make_graphed_callables(model, (_x(device),), **FP8)
    for mb in range(3):  # a full backward, then subset ones: .grad set, then as it was
        x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        with g8.fp8_autocast(recipe=RECIPE):
            ye = eager(xe, is_first_microbatch=mb == 0)
        yg = g(xg, is_first_microbatch=mb == 0)
        loss_e, loss_g = ye.float().square().sum(), yg.float().square().sum()
        if mb == 0:
            loss_e.backward()
            loss_g.backward()
        elif how == "autograd.grad":
            (ge,) = torch.autograd.grad(loss_e, xe)
            (gg,) = torch.autograd.grad(loss_g, xg)
            assert_bitwise_equal(gg, ge, f"mb {mb}: the input's gradient")
        else:
            loss_e.backward(inputs=[xe])
            loss_g.backward(inputs=[xg])
        if xe.grad is not None:
            assert_bitwise_equal(xg.grad, xe.grad, f"mb {mb}: the input's .grad")
        compare_models(eager, model, f"mb {mb}: parameters' .grad and FP8 state")


def test_double_backward_through_a_graphed_callable_raises(device):
    m = build("Linear", device=device)
    g = g8.make_graphed_callables(m, (_x(device),))
    x = _x(device)
    (dx,) = torch.autograd.grad(g(x).float().square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.float().sum().backward()


# Row 3: the step and microbatch graphs in another training mode ----------------------------------


def _mse(y, t):
    return F.mse_loss(y.float(), t.float())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("captured", ["train", "eval"])
@pytest.mark.parametrize("entry", ["microbatch", "step"])
def test_a_replay_in_another_training_mode_raises_before_running(device, entry, captured, fp8):
    """Captured in one mode, called after model.train(not captured mode): raises before any
    FP8 state, weight, gradient or optimizer state moves; the captured mode still replays."""
    model = build("LayerNormMLP", device=device)
    model.train(captured == "train")
    x = torch.randn(2, T, H, dtype=torch.bfloat16, device=device)
    opts = dict(fp8_enabled=fp8, fp8_recipe=RECIPE, num_warmup_iters=1)
    if entry == "step":
        opt = adamw(model.parameters(), device)
        g = g8.make_graphed_step(model, _mse, opt, (x, x.clone()), 2, **opts)
        batch = (x, x)
    else:
        opt = None
        g = g8.make_graphed_microbatch(model, _mse, (x[0], x[1]), **opts)
        batch = (x[0], x[1])
    g(batch)
    model.train(captured != "train")
    before = snapshot(model) + ([] if opt is None else [v.clone() for v in _opt_state(opt)])
    with pytest.raises(RuntimeError, match=rf"captured in {captured} mode, called with model.tr"):
        g(batch)
    after = snapshot(model) + ([] if opt is None else [v.clone() for v in _opt_state(opt)])
    for a, b in zip(after, before, strict=True):
        assert_bitwise_equal(a, b, "nothing ran")
    model.train(captured == "train")
    g(batch)


def _opt_state(opt):
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("entry", ["callables", "microbatch", "step"])
def test_warmup_count_must_be_an_int_on_every_entry_point(entry):
    model = build("Linear")
    x = torch.randn(2, T, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_warmup_iters must be an int >= "):
        if entry == "callables":
            g8.make_graphed_callables(model, (x[0],), num_warmup_iters=True)
        elif entry == "microbatch":
            g8.make_graphed_microbatch(model, None, x[0], num_warmup_iters=True)
        else:
            g8.make_graphed_step(model, None, adamw(model.parameters(), "cpu"), x, 2,
                                 num_warmup_iters=True)  # fmt: skip


# A microbatch that leaves a callable out --------------------------------------------------------


def test_a_microbatch_may_leave_later_callables_out(device):
    layers = [build("LayerNormMLP", device=device) for _ in range(3)]
    eager = copy.deepcopy(layers)
    g = g8.make_graphed_callables(tuple(layers), tuple((_x(device),) for _ in layers), **FP8)
    for mb, used in enumerate([3, 1, 2, 3]):  # this microbatch runs the first `used` layers
        x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
        he, hg = x.clone().requires_grad_(), x.clone().requires_grad_()
        xe, xg = he, hg
        with g8.fp8_autocast(recipe=RECIPE):
            for layer in eager[:used]:
                he = layer(he, is_first_microbatch=mb == 0)
        for layer in g[:used]:
            hg = layer(hg, is_first_microbatch=mb == 0)
        he.float().square().sum().backward()
        hg.float().square().sum().backward()
        assert_bitwise_equal(xg.grad, xe.grad, f"mb {mb} ({used} layers): input grad")
        for le, lg in zip(eager, layers, strict=True):
            compare_models(le, lg, f"mb {mb} ({used} layers)")


def test_leaving_out_the_first_callable_raises_before_running(device):
    layers = (build("LayerNormMLP", device=device), build("LayerNormMLP", device=device))
    g = g8.make_graphed_callables(layers, ((_x(device),), (_x(device),)), **FP8)
    before = snapshot(layers[1])
    with pytest.raises(RuntimeError, match=r"expected the forward of graphed callable 0"):
        g[1](_x(device), is_first_microbatch=True)
    assert_unchanged(layers[1], before, "nothing ran")


# torch.compile(fullgraph=True) around a graphed callable -----------------------------------------


def test_fullgraph_around_a_graphed_callable_says_what_to_do():
    m = build("Linear")
    g = g8.make_graphed_callables(m, (_x("cpu"),))
    compiled = torch.compile(lambda x: g(x.relu()).relu(), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="fullgraph=True") as err:
        compiled(_x("cpu"))
    assert "without fullgraph=True" in str(err.value)
