"""Mistakes real training loops make with graphed callables: each either behaves exactly like eager
or raises a clear error before anything runs (issue 12)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import assert_unchanged, compare_models, snapshot
from tests.modules.common import H, Stack, T, build

RECIPE = g8.DelayedScaling(amax_history_len=4)


def _x(device, requires_grad=True):
    return torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=requires_grad)


def _graphed(kind="Linear", device="cpu", **kw):
    m = build(kind, device=device)
    options = dict(fp8_enabled=True, fp8_recipe=RECIPE, fp8_weight_caching=True) | kw
    return m, g8.make_graphed_callables(m, (_x(device),), **options)


# Item 1: warmup iterations ----------------------------------------------------------------------


@pytest.mark.parametrize("iters", [0, -1])
def test_fp8_capture_needs_a_warmup(iters):
    with pytest.raises(ValueError, match="num_warmup_iters"):
        _graphed(num_warmup_iters=iters)


@pytest.mark.parametrize("iters", [-1, 1.5, True])
def test_warmup_count_must_be_a_non_negative_int(iters):
    with pytest.raises(ValueError, match="num_warmup_iters must be an int >= 0"):
        _graphed(fp8_enabled=False, fp8_weight_caching=False, num_warmup_iters=iters)


def test_no_warmup_without_fp8_equals_eager(device):
    eager = build("LayerNormMLP", device=device)
    model = copy.deepcopy(eager)
    g = g8.make_graphed_callables(model, (_x(device),), num_warmup_iters=0)
    for _ in range(2):
        x = _x(device, requires_grad=False)
        ye, yg = eager(x.clone().requires_grad_()), g(x.clone().requires_grad_())
        assert_bitwise_equal(yg, ye, "output")
        ye.float().square().sum().backward()
        yg.float().square().sum().backward()
        compare_models(eager, model, "no warmup")


# Item 2: a second forward before the first one's backward ----------------------------------------


def test_second_forward_before_backward_raises_before_running(device):
    m, g = _graphed(device=device)
    x0, x1 = _x(device), _x(device)
    a = g(x0, is_first_microbatch=True)
    kept = a.clone()
    before = snapshot(m)
    with pytest.raises(RuntimeError, match=r"called again before the backward of its previous"):
        g(x1, is_first_microbatch=False)
    assert_bitwise_equal(a, kept, "the first output was not overwritten")
    assert_unchanged(m, before, "nothing ran")
    a.float().sum().backward()  # the right way: backward first, then the next microbatch
    g(x1, is_first_microbatch=False).float().sum().backward()


def test_calls_without_a_pending_backward_are_free(device):
    _, g = _graphed(device=device)
    with torch.no_grad():
        for _ in range(3):
            y = g(_x(device), is_first_microbatch=True)
    y = g(_x(device), is_first_microbatch=True)
    del y  # dropped outputs: their backward can never run
    g(_x(device), is_first_microbatch=True).float().sum().backward()


def test_backward_twice_or_through_stale_outputs_raises(device):
    _, g = _graphed(device=device)
    y = g(_x(device), is_first_microbatch=True)
    loss = y.float().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="outputs of an earlier call"):
        loss.backward()


# Item 4: changes after capture ------------------------------------------------------------------


def _load_assign(m):
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in m.state_dict().items()}
    m.load_state_dict(state, assign=True)


def _data_swap(m):
    m.weight.data = m.weight.data.clone()


@pytest.mark.parametrize(
    "change, pattern",
    [
        (_load_assign, r"\['weight', 'bias'\] were replaced"),
        (lambda m: m.weight.requires_grad_(False), r"requires_grad of \['weight \(True -> False"),
        (lambda m: m.bias.register_hook(lambda g: g), r"tensor hooks .* \['bias'\]"),
        (lambda m: m.weight.register_post_accumulate_grad_hook(print), r"tensor hooks"),
        (_data_swap, r"storage of \['weight'\] changed"),
        (lambda m: m.register_forward_pre_hook(lambda *a: None), "hooks were registered"),
    ],
)
@pytest.mark.parametrize("first", [True, False])
def test_changes_after_capture_raise_on_the_next_call(device, change, pattern, first):
    m, g = _graphed(device=device)
    g(_x(device), is_first_microbatch=True).float().sum().backward()
    change(m)
    before = snapshot(m)
    with pytest.raises(RuntimeError, match=pattern) as err:
        g(_x(device), is_first_microbatch=first)
    assert "capture again" in str(err.value) or "Remove them" in str(err.value)
    assert_unchanged(m, before, "nothing ran")


def test_hook_on_a_submodule_raises_on_every_microbatch(device):
    model = Stack(device=device)
    g = g8.make_graphed_callables(model, (_x(device),), fp8_enabled=True, fp8_recipe=RECIPE,
                                  fp8_weight_caching=True)  # fmt: skip
    g(_x(device), is_first_microbatch=True).float().sum().backward()
    model.proj.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="hooks were registered on a captured module"):
        g(_x(device), is_first_microbatch=False)


def test_capture_refuses_tensor_hooks_on_parameters():
    m = build("Linear")
    m.weight.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match=r"parameters \['weight'\] have tensor hooks"):
        g8.make_graphed_callables(m, (_x("cpu"),), fp8_enabled=True)


# Item 5: tensors from outside the callable ----------------------------------------------------


def test_plain_function_with_a_closed_over_parameter_gets_its_grad(device):
    w = torch.randn(H, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    fn = lambda x: x @ w  # noqa: E731
    g = g8.make_graphed_callables(fn, (_x(device),))
    x = _x(device)
    g(x).float().square().sum().backward()
    w_eager, x_eager = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    (x_eager @ w_eager).float().square().sum().backward()
    assert_bitwise_equal(w.grad, w_eager.grad, "closed-over parameter grad")
    assert_bitwise_equal(x.grad, x_eager.grad, "input grad")
    with pytest.raises(RuntimeError, match=r"requires_grad of \['a \(32, 32\) torch.bfloat16"):
        w.requires_grad_(False)
        g(_x(device))


def test_a_non_leaf_from_outside_raises_at_capture():
    w = torch.randn(H, H, requires_grad=True)
    h = w * 2.0  # computed outside the callable: its gradient cannot flow back through a graph
    with pytest.raises(RuntimeError, match=r"computed before the call .*MulBackward0"):
        g8.make_graphed_callables(lambda x: x @ h, (torch.randn(T, H),))


# Capturing twice, deep copies, reset() ------------------------------------------------------------


def test_capturing_a_graphed_module_again_says_what_to_do(device):
    m, g = _graphed(device=device)
    with pytest.raises(RuntimeError, match=r"already captured .* Call reset\(\)"):
        g8.make_graphed_callables(m, (_x(device),), fp8_enabled=True, fp8_recipe=RECIPE)
    parent = torch.nn.Sequential(m)
    with pytest.raises(RuntimeError, match="contains Linear, which an earlier"):
        g8.make_graphed_callables(parent, (_x(device),), fp8_enabled=True, fp8_recipe=RECIPE)
    with pytest.raises(RuntimeError, match="contains Linear, which an earlier"):
        g8.make_graphed_callables(lambda x: m(x), (_x(device),))
    with pytest.raises(ValueError, match="callables 0 and 1 are the same Linear.*order="):
        other = build("Linear", device=device)
        g8.make_graphed_callables((other, other), ((_x(device),), (_x(device),)))


def test_deepcopy_of_a_graphed_module_says_what_to_do():
    m, g = _graphed()
    with pytest.raises(RuntimeError, match="cannot deepcopy a graphed Linear.*reset"):
        copy.deepcopy(torch.nn.Sequential(m))
    g.reset()
    copy.deepcopy(m)


def test_reset_frees_the_graphs_and_allows_a_new_capture(device):
    eager = build("Linear", device=device)
    m = copy.deepcopy(eager)
    g = g8.make_graphed_callables(m, (_x(device),), fp8_enabled=True, fp8_recipe=RECIPE)
    y = g(_x(device))
    y.float().sum().backward()
    static = weakref.ref(m.graphed_runner.pair.static_outputs[0])
    runner = m.graphed_runner
    if device == "cuda":
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
    del y
    g.reset()
    gc.collect()
    assert static() is None, "the static outputs are freed"
    assert "forward" not in vars(m) and not hasattr(m, "graphed_runner")
    assert runner.pair.fwd_graph.released and runner.pair.bwd_graph.released
    if device == "cuda":
        assert torch.cuda.memory_allocated() < allocated
    with g8.fp8_autocast(recipe=RECIPE):
        m(_x(device)).float().sum()  # eager again
    # A new capture of the same module trains exactly like eager.
    eager.load_state_dict(m.state_dict())
    m.zero_grad(set_to_none=True)
    g2 = g8.make_graphed_callables(m, (_x(device),), fp8_enabled=True, fp8_recipe=RECIPE)
    for _ in range(2):
        x = _x(device, requires_grad=False)
        with g8.fp8_autocast(recipe=RECIPE):
            ye = eager(x.clone().requires_grad_())
        yg = g2(x.clone().requires_grad_())
        ye.float().sum().backward()
        yg.float().sum().backward()
        assert_bitwise_equal(yg, ye, "output after recapture")
        compare_models(eager, m, "after recapture")


def test_reset_of_a_plain_function_makes_later_calls_raise():
    g = g8.make_graphed_callables(lambda x: x * 2.0, (torch.randn(T, H),))
    g.reset()
    with pytest.raises(RuntimeError, match=r"reset\(\) released its graphs"):
        g(torch.randn(T, H))


def test_recapture_leaves_existing_grads_alone(device):
    """A second capture of parameters that already have graphed .grad buffers (after reset())
    must not change the accumulated gradients (the CPU tape runs what it records)."""
    m, g = _graphed(device=device)
    g(_x(device), is_first_microbatch=True).float().sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    g.reset()
    g8.make_graphed_callables(m, (_x(device),), fp8_enabled=True, fp8_recipe=RECIPE)
    for p, want in zip(m.parameters(), grads, strict=True):
        assert_bitwise_equal(p.grad, want, "grad after recapture")


# fp8_autocast around graphed calls ----------------------------------------------------------------


def test_graphed_calls_inside_fp8_autocast_with_the_same_recipe(device):
    """TransformerEngine users wrap their whole loop in fp8_autocast: graphed calls inside a
    region with the capture's recipe run exactly as outside one."""
    outside = Stack(device=device)
    inside = copy.deepcopy(outside)
    kw = dict(fp8_enabled=True, fp8_recipe=RECIPE, fp8_weight_caching=True)
    g_out = g8.make_graphed_callables(outside, (_x(device),), **kw)
    g_in = g8.make_graphed_callables(inside, (_x(device),), **kw)
    xs = [_x(device) for _ in range(3)]

    def run(g):
        outs = []
        for mb, x in enumerate(xs):
            y = g(x, is_first_microbatch=mb == 0)
            y.float().square().sum().backward()
            outs.append(y.clone())
        return outs

    want = run(g_out)
    with g8.fp8_autocast(recipe=RECIPE):
        got = run(g_in)
    for mb, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(a, b, f"mb {mb}")
    compare_models(outside, inside, "inside vs outside fp8_autocast")


def test_graphed_calls_inside_a_mismatched_fp8_autocast_raise(device):
    m, g = _graphed(device=device)
    other = g8.DelayedScaling(amax_history_len=8)
    with pytest.raises(RuntimeError, match="captured with fp8_recipe=.*called inside fp8_aut"):
        with g8.fp8_autocast(recipe=other):
            g(_x(device), is_first_microbatch=True)
    with pytest.raises(RuntimeError, match=r"fp8_enabled=True, called inside .*enabled=False"):
        with g8.fp8_autocast(enabled=False):
            g(_x(device), is_first_microbatch=True)
    hp = build("Linear", device=device)
    g_hp = g8.make_graphed_callables(hp, (_x(device),))
    with pytest.raises(RuntimeError, match=r"fp8_enabled=False, called inside .*enabled=True"):
        with g8.fp8_autocast(recipe=RECIPE):
            g_hp(_x(device))
    plain = g8.make_graphed_callables(torch.nn.GELU(), (_x(device),))
    with g8.fp8_autocast(recipe=RECIPE):  # no FP8 module inside: nothing to disagree on
        plain(_x(device)).float().sum().backward()


def test_a_dropped_graphed_model_is_freed():
    m, g = _graphed()
    g(_x("cpu"), is_first_microbatch=True).float().sum().backward()
    ref = weakref.ref(m)
    del m, g
    gc.collect()
    assert ref() is None, "the capture registry keeps no graphed model alive"


def test_replacing_a_submodule_after_capture_raises():
    model = Stack()
    g = g8.make_graphed_callables(model, (_x("cpu"),), fp8_enabled=True, fp8_recipe=RECIPE)
    model.act = torch.nn.ReLU()
    with pytest.raises(RuntimeError, match=r"\['act'\] were replaced after capture"):
        g(_x("cpu"))
