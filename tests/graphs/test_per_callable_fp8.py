"""make_graphed_callables with one fp8_enabled / fp8_recipe per callable (TransformerEngine's
per-callable fp8_enabled): each callable replays what it computes eagerly in its own
fp8_autocast region, bit for bit, and a malformed tuple raises before anything is captured."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from tests.graphs.common import train_layers
from tests.graphs.schedules import train_schedule
from tests.graphs.step_common import TinyLM, adamw, lm_batch, lm_loss
from tests.modules.common import H, T

DELAYED, CURRENT = g8.DelayedScaling(), g8.Float8CurrentScaling()


MIXTURES = [(False, True), (True, False), (False, False), (True, True)]


@pytest.mark.parametrize("flags", MIXTURES)
@pytest.mark.parametrize("caching", [True, False])
def test_each_callable_runs_its_own_fp8_setting(device, flags, caching):
    """Fails before the fix for (False, True) and (True, False): every callable ran in FP8."""
    train_layers(("Linear", "Linear"), flags, (None, None), caching, device)


@pytest.mark.parametrize(
    "kinds",
    [
        ("LayerNormMLP", "Linear", "LayerNormLinear"),
        ("TransformerLayer", "TransformerLayer", "TransformerLayer"),
    ],
)
def test_first_and_last_layers_in_bf16(device, kinds):
    """Megatron's --first-last-layers-bf16: the outer layers keep no FP8 state at all."""
    _, eager = train_layers(kinds, (False, True, False), (None,) * 3, True, device)
    has_state = [any(getattr(m, "fp8_meta", None) is not None for m in layer.modules())
                 for layer in eager.layers]  # fmt: skip
    assert has_state == [False, True, False]


def test_a_recipe_per_callable(device):
    """Delayed and current scaling side by side: each recipe's state in its own arena."""
    _, eager = train_layers(("Linear", "Linear", "Linear"), (True, True, False),
                      (DELAYED, CURRENT, None), True, device)  # fmt: skip
    metas = [m.fp8_meta for m in eager.layers[:2]]
    assert [m.recipe for m in metas] == [DELAYED, CURRENT]


def test_the_mixture_differs_from_all_fp8(device):
    """The per-callable setting matters: (False, True) is not the all-FP8 run."""
    mixed, _ = train_layers(("Linear", "Linear"), (False, True), (None, None), False, device, 1, 1)
    torch.manual_seed(1234)
    all_fp8, _ = train_layers(("Linear", "Linear"), (True, True), (None, None), False, device, 1, 1)
    assert not torch.equal(mixed[0], all_fp8[0])


@pytest.mark.parametrize("flags", [(True, False, False, True), (False, True, True, False)])
def test_a_pipeline_schedule_with_bf16_layers(device, flags):
    """With `order` (2 chunks of 2 layers, interleaved 1F1B): one flag per layer, chunk-major."""
    train_schedule(device, torch.bfloat16, True, layers_per_chunk=2, flags=flags)


def _two(device):
    layers = [g8.Linear(H, H, params_dtype=torch.bfloat16, device=device) for _ in range(2)]
    samples = tuple((torch.randn(T, H, dtype=torch.bfloat16, device=device,
                                 requires_grad=True),) for _ in layers)  # fmt: skip
    return tuple(layers), samples


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(fp8_enabled=(True,)), ValueError, r"one entry per callable \(2\), got 1"),
        (dict(fp8_enabled=(True, False, True)), ValueError, "one entry per callable"),
        (dict(fp8_enabled=(True, 1)), TypeError, "one bool per callable, got 1 for callable 1"),
        (dict(fp8_enabled=(True, None)), TypeError, "one bool per callable"),
        (dict(fp8_enabled=[True, False]), ValueError, "as a tuple"),
        (dict(fp8_enabled=True, fp8_recipe=(DELAYED,)), ValueError, "one entry per callable"),
        (dict(fp8_enabled=True, fp8_recipe=(DELAYED, "x")), TypeError, "fp8_recipe"),
    ],
)
def test_a_malformed_tuple_raises_before_capture(device, kwargs, error, match):
    layers, samples = _two(device)
    with pytest.raises(error, match=match):
        g8.make_graphed_callables(layers, samples, **kwargs)
    assert all(m.fp8_meta is None and "forward" not in vars(m) for m in layers)


def test_the_step_graph_takes_one_setting(device):
    """make_graphed_step and make_graphed_microbatch hold one graph: a tuple raises, naming
    the fp8_autocast regions that keep layers out of FP8 inside it."""
    model = TinyLM(device)
    opt = adamw(model.parameters(), device)
    with pytest.raises(TypeError, match="fp8_autocast"):
        g8.make_graphed_step(model, lm_loss, opt, lm_batch(2, device, 0), 2,
                             fp8_enabled=(False, True))  # fmt: skip
    with pytest.raises(TypeError, match="fp8_autocast"):
        g8.make_graphed_microbatch(model, lm_loss, lm_batch(1, device, 0)[0],
                                   fp8_enabled=(True,))  # fmt: skip
    assert all(getattr(m, "fp8_meta", None) is None for m in model.modules())


def test_a_bf16_callable_refuses_an_fp8_region(device):
    """Inside fp8_autocast(enabled=True) an eager call of the bf16 layer would run in FP8; its
    graph cannot, so the call raises (as a whole capture with the other flag does)."""
    layers, samples = _two(device)
    graphed = g8.make_graphed_callables(layers, samples, fp8_enabled=(False, True))
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    with g8.fp8_autocast(), pytest.raises(RuntimeError, match="fp8_enabled=False"):
        graphed[0](x)
    with g8.fp8_autocast(enabled=False), pytest.raises(RuntimeError, match="fp8_enabled=True"):
        graphed[1](x)
    with g8.fp8_autocast(enabled=False):
        graphed[0](x)
