"""FP8 attention's E4M3 backward under HYBRID (DelayedScaling(fp8_dpa_e4m3_bwd=True),
notes/FP8_ATTENTION.md): the kernel gets an E4M3 dO at the slot's scale times 448/57344 and returns
E4M3 gradients at theirs times the same, while the slots' amaxes and scale update stay the E5M2
arena's; under Format.E4M3 the option changes nothing; the recipe checks it."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8 import reference
from graphfp8.fp8.recipe import fp8_max
from graphfp8.fp8.slots import AttnBwdRole
from graphfp8.testing import assert_bitwise_equal
from tests.modules.attention_common import OpRecorder, layer_and_input

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FACTOR = fp8_max(E4M3) / fp8_max(E5M2)  # 2**-7


def _recipe(fmt=g8.Format.HYBRID, e4m3_bwd=True):
    return g8.DelayedScaling(fp8_format=fmt, amax_history_len=4, fp8_dpa=True, fp8_mha=True,
                             fp8_dpa_e4m3_bwd=e4m3_bwd)  # fmt: skip


def test_backward_runs_in_e4m3_at_the_slot_scales_times_the_ratio(device):
    """The recorded kernel call: dO and dQ, dK, dV in E4M3; every backward scale the slot's
    times 448/57344 exactly, every descale its reciprocal; dO's FP8 codes the E4M3 cast of dO at
    that scale; the amaxes (dO exact, dP/dQ/dK/dV against the twin on the recorded tensors) and
    the next scales (the E5M2 arena's scaled_max over the history) as without the option."""
    m, x = layer_and_input(device)
    recipe = _recipe()
    assert FACTOR == 2.0**-7
    with g8.fp8_autocast(recipe=recipe):  # a first step, so that no scale is 1
        m(x.clone().requires_grad_()).float().sum().backward()
    meta = m.core_attention.fp8_meta
    assert meta.bwd.arena.fp8_dtype == E5M2
    rec = OpRecorder()
    with rec:
        with g8.fp8_autocast(recipe=recipe):
            y = m(x.clone().requires_grad_())
        slot_scale = meta.bwd.scales().clone()  # what this backward quantizes with
        assert not torch.all(slot_scale == 1.0)
        y.float().square().sum().backward()
    call = rec.calls["sdpa_fp8_backward"][-1]
    ((_, _, _, _, d_o, _, scales, *_), _), grads, (raw_args, _) = call
    assert d_o.dtype == E4M3 and all(g.dtype == E4M3 for g in grads)
    for role, name in ((AttnBwdRole.DP, "scale_dp"), (AttnBwdRole.DQ, "scale_dq"),
                       (AttnBwdRole.DK, "scale_dk"), (AttnBwdRole.DV, "scale_dv")):  # fmt: skip
        assert_bitwise_equal(scales[name], slot_scale[role : role + 1] * FACTOR, name)
    do_scale = slot_scale[AttnBwdRole.DO : AttnBwdRole.DO + 1] * FACTOR
    assert_bitwise_equal(scales["descale_do"], torch.reciprocal(do_scale))
    ptr = raw_args[4].data_ptr()  # the FP8 dO the kernel read: the cast that wrote it
    casts = [c for c in rec.calls["cast_to_fp8"] if c[2][1][0].data_ptr() == ptr]
    (dy, scale, _, dtype), _ = casts[-1][0]
    assert dtype == E4M3
    assert_bitwise_equal(scale, do_scale)
    assert_bitwise_equal(d_o.view(torch.uint8), reference.quantize(dy, do_scale, E4M3).view(
        torch.uint8))  # fmt: skip
    rec.check_backward(meta, m.core_attention.attn_scale, device)


def _train(recipe, device, steps: int = 2):
    m, x = layer_and_input(device)
    for _ in range(steps):
        xi = x.clone().requires_grad_()
        with g8.fp8_autocast(recipe=recipe):
            y = m(xi)
        y.float().square().sum().backward()
    meta = m.core_attention.fp8_meta
    state = [meta.bwd.history(), meta.bwd.scales(), meta.fwd.history(), meta.fwd.scales()]
    return [xi.grad, *(p.grad for p in m.parameters()), *state]


def test_option_changes_nothing_under_e4m3_and_everything_under_hybrid():
    """Format.E4M3's backward is E4M3 already: the same bits with and without the option. Under
    HYBRID it moves the input gradient (a check that the option is not ignored). On the CPU:
    cuDNN's FP8 backward differs run to run on the H200 (docs/fp8.md), and the option builds
    the same cuDNN graph key as Format.E4M3 there (backward_dtype)."""
    device = "cpu"
    with_opt = _train(_recipe(g8.Format.E4M3), device)
    for mine, theirs in zip(with_opt, _train(_recipe(g8.Format.E4M3, False), device), strict=True):
        assert_bitwise_equal(mine, theirs)
    hybrid, hybrid_opt = _train(_recipe(e4m3_bwd=False), device), _train(_recipe(), device)
    assert not torch.equal(hybrid[0], hybrid_opt[0])


def test_recipe_checks_the_option():
    with pytest.raises(ValueError, match="fp8_dpa_e4m3_bwd=True needs fp8_dpa=True"):
        g8.DelayedScaling(fp8_dpa_e4m3_bwd=True)
    with pytest.raises(ValueError, match="fp8_dpa_e4m3_bwd must be a bool"):
        g8.DelayedScaling(fp8_dpa=True, fp8_dpa_e4m3_bwd=1)
    assert g8.Float8CurrentScaling().fp8_dpa_e4m3_bwd is False
    assert "fp8_dpa_e4m3_bwd=True" in repr(_recipe())


def test_numerics_report_gives_do_its_amax_only():
    """graphfp8.numerics under the option: the dO row reports the slot's recorded amax and no
    statistics of its own (they would describe an E5M2 cast that did not happen), like the casts
    inside the kernel; the other rows as without the option. Three steps: fresh slots (scale 1,
    here 2**-7 in E4M3) flush this layer's small gradients until dO's and then dS's slot have an
    amax, so dQ and dK are 0 in the first two backward passes (docs/fp8.md)."""
    from graphfp8.numerics import FP8Stats

    layer, sample = layer_and_input("cpu")
    with FP8Stats(layer) as stats:
        stats.enable(True)
        for step in range(3):
            with g8.fp8_autocast(recipe=_recipe()):
                y = layer(sample.clone().requires_grad_())
            y.float().square().mean().backward()
            stats.collect(step)
        rows = stats.rows()
    first = {r["role"]: r for r in rows if r["gemm"] == "attention" and r["step"] == 0}
    assert first["dq"]["recorded_amax"] == 0.0 and first["do"]["recorded_amax"] > 0
    attn = {r["role"]: r for r in rows if r["gemm"] == "attention" and r["step"] == 2}
    assert set(attn) == {"q", "k", "v", "o", "do", "dq", "dk", "dv"}
    for role in ("q", "k", "v", "o", "do", "dq", "dk", "dv"):
        r = attn[role]
        assert r["true_amax"] is None and r["sqnr_db"] is None and r["recorded_amax"] > 0, role
