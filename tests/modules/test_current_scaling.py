"""Float8CurrentScaling: each cast's scale comes from the tensor it casts (checked against the
reference twin), the FP8 math equals delayed scaling run with those scales, SQNR, special values,
recipe validation and checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8 import reference
from graphfp8.fp8.recipe import fp8_max
from graphfp8.fp8.slots import BwdRole, FwdRole, slot_index
from graphfp8.testing import assert_bitwise_equal, sqnr
from tests.modules.common import H, T, build, extra_state, torch_twin

CURRENT = g8.Float8CurrentScaling()


def _linear_scales(m, x, dy, fmt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference scales of the input, weight and grad-output casts of a fresh Linear."""
    one = torch.ones(1, device=x.device)
    fwd_max = torch.tensor([fp8_max(fmt.fwd_dtype)], device=x.device)
    bwd_max = torch.tensor([fp8_max(fmt.bwd_dtype)], device=x.device)
    return (
        reference.current_scale(x, one, fwd_max),
        reference.current_scale(m.weight.detach(), one, fwd_max),
        reference.current_scale(dy, one, bwd_max),
    )


@pytest.mark.parametrize("fmt", [g8.Format.HYBRID, g8.Format.E4M3])
def test_linear_scales_and_math_equal_delayed_scaling_with_those_scales(device, fmt):
    """Each slot's scale equals the twin's scale of the tensor it cast; output and grads equal a
    DelayedScaling run whose scales were set to those values beforehand."""
    m = g8.Linear(H, 2 * H, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(m)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device) * 3
    dy = torch.randn(T, 2 * H, dtype=torch.bfloat16, device=device) / 7
    s_x, s_w, s_dy = _linear_scales(m, x, dy, fmt)

    xc = x.clone().requires_grad_()
    with g8.fp8_autocast(recipe=g8.Float8CurrentScaling(fp8_format=fmt)):
        y = m(xc)
    y.backward(dy)
    meta = m.fp8_meta
    assert_bitwise_equal(meta.fwd.scales()[slot_index(FwdRole.INPUT, 0)], s_x[0], "input scale")
    assert_bitwise_equal(meta.fwd.scales()[slot_index(FwdRole.WEIGHT, 0)], s_w[0], "weight")
    assert_bitwise_equal(meta.bwd.scales()[slot_index(BwdRole.GRAD_OUTPUT, 0)], s_dy[0], "dy")
    assert torch.equal(meta.fwd.history(), torch.zeros_like(meta.fwd.history()))

    delayed = g8.DelayedScaling(fp8_format=fmt, amax_history_len=1)
    tw = twin.fp8_init(delayed, device)
    tw.fwd.scales().copy_(torch.cat([s_x, s_w, torch.ones(1, device=device)]))
    tw.bwd.scales().copy_(s_dy)
    xd = x.clone().requires_grad_()
    with g8.fp8_autocast(recipe=delayed):
        yd = twin(xd)
    yd.backward(dy)
    assert_bitwise_equal(y, yd, "output")
    assert_bitwise_equal(xc.grad, xd.grad, "dgrad")
    assert_bitwise_equal(m.weight.grad, twin.weight.grad, "wgrad")
    assert_bitwise_equal(m.bias.grad, twin.bias.grad, "dbias")


def test_scale_follows_each_tensor_without_history(device):
    """A tensor 1000x smaller right after a large one gets its own, 1000x larger, scale."""
    m = g8.Linear(H, H, params_dtype=torch.float32, device=device)
    one = torch.ones(1, device=device)
    for mult in (100.0, 0.1):
        x = torch.randn(T, H, device=device) * mult
        with g8.fp8_autocast(recipe=CURRENT), torch.no_grad():
            m(x)
        want = reference.current_scale(x, one, torch.tensor([448.0], device=device))
        assert_bitwise_equal(m.fp8_meta.fwd.scales()[0], want[0], f"input scale, x * {mult}")


@pytest.mark.parametrize("special", ["zero", "inf", "nan"])
def test_special_tensors_keep_the_previous_scale_like_delayed_scaling(device, special):
    """Zero and inf amaxes keep the slot's previous scale (as a delayed update does); NaNs are
    ignored by the amax, as every cast ignores them."""
    m = g8.Linear(H, H, params_dtype=torch.float32, device=device)
    x = torch.randn(T, H, device=device)
    with g8.fp8_autocast(recipe=CURRENT), torch.no_grad():
        m(x)
    prev = m.fp8_meta.fwd.scales()[0:1].clone()
    bad = {"zero": torch.zeros_like(x), "inf": x.clone(), "nan": x.clone()}[special]
    bad[3, 5] = {"zero": 0.0, "inf": float("inf"), "nan": float("nan")}[special]
    with g8.fp8_autocast(recipe=CURRENT), torch.no_grad():
        m(bad)
    got = m.fp8_meta.fwd.scales()[0:1]
    want = reference.current_scale(bad, prev, torch.tensor([448.0], device=device))
    assert_bitwise_equal(got, want, "scale")
    if special != "nan":
        assert_bitwise_equal(got, prev, "kept scale")


def test_cached_weight_leaves_its_slot_alone(device):
    """is_first_microbatch=False reuses the FP8 weight: no amax pass, the weight's scale stays."""
    m = g8.Linear(H, H, params_dtype=torch.float32, device=device)
    with g8.fp8_autocast(recipe=CURRENT), torch.no_grad():
        m(torch.randn(T, H, device=device), is_first_microbatch=True)
        before = m.fp8_meta.fwd.scales().clone()
        m.weight.mul_(10)
        m(torch.randn(T, H, device=device), is_first_microbatch=False)
    w = slot_index(FwdRole.WEIGHT, 0)
    assert_bitwise_equal(m.fp8_meta.fwd.scales()[w], before[w], "weight scale")


def test_sqnr_beats_delayed_scaling_when_data_shrinks(device):
    """Batches that shrink 1000x each step: delayed scaling's scale still comes from the large
    amaxes in its history, pushing the small input into FP8's subnormals; current scaling scales
    each batch to the full E4M3 range. (The floors of docs/benchmarking.md on steady data:
    tests/modules/test_numerics.py, both recipes.)"""
    m = g8.Linear(H, 2 * H, params_dtype=torch.bfloat16, device=device)
    models = {"current": m, "delayed": copy.deepcopy(m)}
    recipes = {"current": CURRENT, "delayed": g8.DelayedScaling(amax_history_len=16)}
    out = {}
    for step in range(3):
        x = torch.randn(T, H, dtype=torch.bfloat16, device=device) * 1e3 ** (1 - step)
        for name, model in models.items():
            with g8.fp8_autocast(recipe=recipes[name]), torch.no_grad():
                out[name] = model(x)
    want = torch_twin(copy.deepcopy(m).float())(x.float())
    current, delayed = sqnr(want, out["current"]), sqnr(want, out["delayed"])
    assert current >= 25.0, f"current scaling: {current:.1f} dB"
    assert current > delayed + 5.0, f"current {current:.1f} dB, delayed {delayed:.1f} dB"


def test_recipe_validation_and_misuse():
    with pytest.raises(ValueError, match="fp8_format must be a graphfp8.Format"):
        g8.Float8CurrentScaling(fp8_format="HYBRID")
    with pytest.raises(TypeError):
        g8.Float8CurrentScaling(margin=1)  # fixed fields are not arguments
    with pytest.raises(TypeError, match="Float8CurrentScaling or graphfp8.Float8BlockScaling"):
        with g8.fp8_autocast(recipe="current"):
            pass
    m = g8.Linear(H, H, params_dtype=torch.float32)
    with g8.fp8_autocast(recipe=g8.DelayedScaling(amax_history_len=4)), torch.no_grad():
        m(torch.randn(T, H))
    with pytest.raises(ValueError, match="DelayedScaling -> Float8CurrentScaling"):
        with g8.fp8_autocast(recipe=CURRENT), torch.no_grad():
            m(torch.randn(T, H))


def test_checkpoint_round_trip_keeps_the_recipe(device):
    m = build("LayerNormMLP", device=device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    recipe = g8.Float8CurrentScaling(fp8_format=g8.Format.E4M3)
    with g8.fp8_autocast(recipe=recipe), torch.no_grad():
        m(x)
    state = m.state_dict()
    assert extra_state(state["_extra_state"])["recipe"] == recipe
    other = build("LayerNormMLP", device=device)
    other.load_state_dict(state)
    assert other.fp8_meta.recipe == recipe
    assert_bitwise_equal(other.fp8_meta.fwd.scales(), m.fp8_meta.fwd.scales(), "scales")
    with g8.fp8_autocast(recipe=recipe), torch.no_grad():
        assert_bitwise_equal(other(x), m(x), "output after load")


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fused_norm_cast_takes_its_scale_from_the_norm_output(device, normalization):
    """LayerNormLinear's norm writes the GEMM's FP8 input itself: under current scaling the norm
    kernel runs once more as the amax pass, and the INPUT scale follows the norm's output (within
    the rounding of the high-precision copy we compare against)."""
    m = g8.LayerNormLinear(H, H, normalization=normalization, return_layernorm_output=True,
                           params_dtype=torch.float32, device=device)  # fmt: skip
    x = torch.randn(T, H, device=device) * 100
    with g8.fp8_autocast(recipe=CURRENT), torch.no_grad():
        _, ln_out = m(x)
    want = 448.0 / ln_out.abs().max()
    got = m.fp8_meta.fwd.scales()[slot_index(FwdRole.INPUT, 0)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
