"""Grouped-query attention in TransformerLayer (num_gqa_groups G < heads): the fused QKV layout,
against the same layer with its key/value heads repeated (MHA), in bf16 and with FP8 GEMMs and
FP8 attention; slots, checkpoints, graphed == eager."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal, sqnr
from tests.graphs.common import train_pair
from tests.modules.attention_common import DPA, MHA, OpRecorder, layer_and_input, shape_for
from tests.modules.common import fp8_state


def _as_mha(gqa: g8.TransformerLayer) -> g8.TransformerLayer:
    """The MHA layer that computes what `gqa` computes: each k/v head repeated for the heads /
    G query heads it serves (the rows of the fused QKV weight and bias)."""
    h, g, d = gqa.num_heads, gqa.num_gqa_groups, gqa.head_dim
    mha = g8.TransformerLayer(gqa.hidden_size, h, gqa.ffn_hidden_size, max_seq_len=gqa.max_seq_len,
                              params_dtype=gqa.qkv.weight.dtype,
                              device=gqa.qkv.weight.device)  # fmt: skip
    state = gqa.state_dict()

    def repeat_rows(t):
        q, k, v = t.split([h * d, g * d, g * d])
        rep = lambda x: x.view(g, d, *x.shape[1:]).repeat_interleave(h // g, 0).flatten(0, 1)  # noqa: E731
        return torch.cat([q, rep(k), rep(v)])

    state["qkv.weight"] = repeat_rows(state["qkv.weight"])
    state["qkv.bias"] = repeat_rows(state["qkv.bias"])
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("recipe", [None, g8.DelayedScaling(amax_history_len=4), DPA],
                         ids=["bf16", "fp8 gemms", "fp8 attention"])  # fmt: skip
def test_gqa_equals_mha_with_repeated_kv_heads(device, recipe):
    """The forward is the MHA layer's, bit for bit on the CPU (with FP8 attention too: the K/V
    amaxes and casts see the same values; on the GPU to 40 dB); each k/v head's weight gradient
    is the sum of its repeated heads' - to float32 summation order in bf16; in FP8 the two
    quantize different gradients (dK of the group summed, or dK per head) in E5M2, so they agree
    to its rounding only (>= 15 dB, the floor of HYBRID gradients through FP8 attention in
    test_attention.py)."""
    gqa, x = layer_and_input(device, groups=1)
    mha = _as_mha(gqa)
    xg, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    with g8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        yg, ym = gqa(xg), mha(xm)
    if device == "cpu":
        assert_bitwise_equal(yg, ym, "output")
    else:  # GPU kernels (flash / cuDNN) may tile a GQA call differently
        assert sqnr(ym.float(), yg.float()) > 40.0
    dy = torch.randn_like(yg)
    yg.backward(dy)
    ym.backward(dy)
    assert sqnr(xm.grad.float(), xg.grad.float()) > 30.0
    h, d = gqa.num_heads, gqa.head_dim
    dw = mha.qkv.weight.grad.float()
    k_sum = dw[h * d : 2 * h * d].view(h, d, -1).sum(0)
    got_k = gqa.qkv.weight.grad.float()[h * d : (h + 1) * d]
    assert sqnr(k_sum, got_k) > (30.0 if recipe is None else 15.0)


def test_fp8_attention_slots_with_gqa(device):
    """Every attention slot's amax and scale_inv against the recorded tensors, G < heads."""
    m, x = layer_and_input(device, groups=1)
    recipe = g8.DelayedScaling(amax_history_len=4, fp8_dpa=True, fp8_mha=True)
    with g8.fp8_autocast(recipe=recipe):
        m(x.clone().requires_grad_()).float().sum().backward()
    rec = OpRecorder()
    meta = m.core_attention.fp8_meta
    with rec:
        with g8.fp8_autocast(recipe=recipe):
            y = m(x.clone().requires_grad_())
        fwd_h0, fwd_scale = meta.fwd.history()[0].clone(), meta.fwd.scales().clone()
        y.float().square().sum().backward()
    (_, (parts, _), _) = rec.calls["rope_fp8"][-1]
    b, s, h, d = shape_for(device)
    assert [tuple(p.shape) for p in parts] == [(b, s, h, d), (b, s, 1, d), (b, s, 1, d)]
    rec.check_forward(fwd_h0, fwd_scale, m.core_attention.attn_scale, device)
    rec.check_backward(meta, m.core_attention.attn_scale, device)


@pytest.mark.parametrize("recipe", [g8.DelayedScaling(amax_history_len=4), MHA],
                         ids=["fp8 gemms", "fp8 mha"])  # fmt: skip
def test_graphed_equals_eager_with_gqa(device, recipe):
    eager, sample = layer_and_input(device, groups=1)
    train_pair(eager, sample, recipe, True, steps=2, mbs=2)


def test_checkpoint_round_trip(device):
    m, x = layer_and_input(device, groups=1)
    with g8.fp8_autocast(recipe=MHA):
        m(x.clone().requires_grad_()).float().sum().backward()
    h, d = m.num_heads, m.head_dim
    assert m.state_dict()["qkv.weight"].shape == ((h + 2) * d, h * d)
    other, _ = layer_and_input(device, seed=7, groups=1)
    other.load_state_dict(m.state_dict())
    with torch.no_grad(), g8.fp8_autocast(recipe=MHA):
        assert_bitwise_equal(other(x), m(x))
    for (name, a), (_, b) in zip(fp8_state(m), fp8_state(other), strict=True):
        assert_bitwise_equal(b, a, name)
    mha = g8.TransformerLayer(h * d, h, 2 * h * d, max_seq_len=x.shape[1], device=device,
                              params_dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(RuntimeError, match="size mismatch for qkv.weight"):
        mha.load_state_dict(copy.deepcopy(m.state_dict()))


def test_bad_groups():
    with pytest.raises(ValueError, match="multiple of num_gqa_groups"):
        g8.TransformerLayer(64, 4, 128, num_gqa_groups=3)
