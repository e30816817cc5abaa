"""Weight caching (is_first_microbatch), scale/cached-weight pairing, Float8Tensor chaining,
checkpoints, convert() and input checks of the FP8 modules."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal, sqnr
from tests.modules.common import H, Stack, T, build, fp8_state, torch_twin

RECIPE = g8.DelayedScaling(amax_history_len=4)


def _step(m, x, first, recipe=RECIPE):
    with g8.fp8_autocast(recipe=recipe):
        y = m(x, is_first_microbatch=first)
    y.float().square().mean().backward()
    return y


def test_is_first_microbatch_semantics(device):
    m = build("Linear", device=device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="is_first_microbatch=False before any"):
        _step(m, x, False)
    ws = lambda: m.weight_cache.workspaces["weight"]._data.clone()  # noqa: E731
    _step(m, x, True)
    cached = ws()
    with torch.no_grad():
        m.weight.mul_(2.0)  # an optimizer step
    _step(m, x, False)
    assert_bitwise_equal(ws(), cached, "False reuses the cache")
    _step(m, x, None)
    assert not torch.equal(ws().view(torch.uint8), cached.view(torch.uint8)), "None recasts"
    cached = ws()
    _step(m, x, False)
    assert_bitwise_equal(ws(), cached)
    with pytest.raises(TypeError, match="must be None, True or False"):
        _step(m, x, 1)


def test_cached_weight_keeps_its_scale_inv_while_scales_move(device):
    """History length 1 and inputs shrinking 10x per microbatch: the slots' scales move every
    microbatch (shrinking, so the delayed input scale never saturates). The cached FP8 weight
    must keep dequantizing, with its own scale_inv, to the weight, and the GEMM must use that
    scale_inv - the scale/cached-weight mismatch TransformerEngine once shipped."""
    recipe = g8.DelayedScaling(amax_history_len=1)
    m = build("Linear", device=device)
    twin = torch_twin(m)
    meta_scales = []
    for mb in range(5):
        x = torch.randn(T, H, dtype=torch.bfloat16, device=device) * 10.0 ** (2 - mb)
        y = _step(m, x, mb == 0, recipe)
        w_fp8 = m.weight_cache.workspaces["weight"]
        meta_scales.append(m.fp8_meta.fwd.scales().clone())
        deq = w_fp8.dequantize(torch.float32)
        assert sqnr(m.weight.float(), deq) > 25.0, "cached weight dequantizes to the weight"
        if mb >= 1:
            # The weight slot's scale has moved on (1.0 at the cast, 448/amax after), the
            # cached weight still carries the scale_inv it was cast with.
            assert meta_scales[-1][1].item() != 1.0
            assert w_fp8._scale_inv.item() == 1.0
            assert sqnr(twin(x).float(), y.float()) > 20.0
    assert not torch.equal(meta_scales[1][0], meta_scales[2][0]), "input scale moved"


def test_fp8_output_chain_skips_a_cast(device):
    m = Stack(device=device, fp8_output=True)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    with g8.fp8_autocast(recipe=RECIPE):
        h = m.qkv(x)
        assert isinstance(h, g8.Float8Tensor) and h.shape == (T, 2 * H)
        assert h._transpose_valid, "the producer wrote both layouts"
        y = m.proj(h)
    y.float().sum().backward()
    assert x.grad is not None and m.qkv.weight.grad is not None
    assert m.proj.fp8_meta.fwd.history()[:, 0].abs().sum() == 0, "proj never cast its input"
    assert m.qkv.fp8_meta.fwd.history()[0, 2] > 0, "qkv's output slot recorded the amax"
    ref = torch_twin(m.proj)(torch_twin(m.qkv)(x.detach()))
    assert sqnr(ref.float(), y.float()) > 20.0


def test_leading_dims_and_non_contiguous_inputs(device):
    m = build("LayerNormMLP", device=device)
    x = torch.randn(3, T, H, dtype=torch.bfloat16, device=device)
    with g8.fp8_autocast(recipe=RECIPE):
        y3 = m(x, is_first_microbatch=True)
        y2 = m(x.reshape(-1, H), is_first_microbatch=False)
        xt = x.reshape(-1, H).t().contiguous().t()  # same values, column-major
        assert not xt.is_contiguous()
        ync = m(xt, is_first_microbatch=False)
    assert y3.shape == (3, T, H)
    assert_bitwise_equal(y3.reshape(-1, H), y2)
    assert_bitwise_equal(ync, y2)


def test_bad_inputs():
    m = build("Linear")
    with g8.fp8_autocast(recipe=RECIPE):
        with pytest.raises(ValueError, match=r"expected input \(\.\.\., 32\), got \(48, 31\)"):
            m(torch.randn(T, H - 1, dtype=torch.bfloat16))
        with pytest.raises(TypeError, match="input dtype torch.float32 does not match"):
            m(torch.randn(T, H))
        with pytest.raises(ValueError, match="input is on meta but the parameters are on cpu"):
            m(torch.randn(T, H, dtype=torch.bfloat16, device="meta"))
        with pytest.raises(TypeError, match="input must be a tensor"):
            m([1.0] * H)
        with pytest.raises(ValueError, match="token count .* multiple of 16 .* got 20"):
            m(torch.randn(20, H, dtype=torch.bfloat16))
        with torch.no_grad():  # no weight gradient: any token count works
            assert m(torch.randn(20, H, dtype=torch.bfloat16)).shape == (20, 2 * H)
        odd = g8.Linear(24, 32, params_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="multiples of 16, got k=24, n=32"):
            odd(torch.randn(T, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="normalization must be one of"):
        g8.LayerNormLinear(H, H, normalization="BatchNorm")
    with pytest.raises(ValueError, match="activation must be one of"):
        g8.LayerNormMLP(H, H, activation="swish")


def _train(model, xs, opt, recipe=RECIPE):
    for i, x in enumerate(xs):
        _step(model, x, i % 2 == 0, recipe)
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()


def test_checkpoint_round_trip_and_resume_is_bit_exact(device):
    torch.manual_seed(0)
    xs = [torch.randn(T, H, dtype=torch.bfloat16, device=device) for _ in range(8)]
    a = Stack(device=device)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _train(a, xs[:4], opt_a)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    b = Stack(device=device)
    b.load_state_dict(ckpt["model"])
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    opt_b.load_state_dict(ckpt["opt"])
    for (name, sa), (_, sb) in zip(fp8_state(a), fp8_state(b), strict=True):
        assert_bitwise_equal(sb, sa, f"loaded {name}")
    _train(a, xs[4:], opt_a)  # uninterrupted
    _train(b, xs[4:], opt_b)  # resumed
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert_bitwise_equal(pb, pa, name)
    for (name, sa), (_, sb) in zip(fp8_state(a), fp8_state(b), strict=True):
        assert_bitwise_equal(sb, sa, name)


def test_checkpoint_history_length_mismatch():
    a = build("Linear")
    _step(a, torch.randn(T, H, dtype=torch.bfloat16), True, g8.DelayedScaling(amax_history_len=16))
    b = build("Linear")
    _step(b, torch.randn(T, H, dtype=torch.bfloat16), True, RECIPE)
    with pytest.raises(ValueError, match="checkpoint's FP8 state .* has amax_history_len=16, "
                       "the module's FP8 state has 4"):  # fmt: skip
        b.load_state_dict(a.state_dict())
    c = build("Linear")
    c.load_state_dict(a.state_dict())  # a fresh module takes the checkpoint's recipe
    with pytest.raises(ValueError, match="amax_history_len=16, the recipe asks for 4"):
        _step(c, torch.randn(T, H, dtype=torch.bfloat16), True, RECIPE)
    assert build("Linear").state_dict()["_extra_state"].numel() == 2  # no FP8 state


def test_convert_swaps_layers_and_keeps_weights():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.LayerNorm(H), nn.Linear(H, 2 * H), nn.GELU(), nn.Sequential(nn.Linear(2 * H, H))
    ).to(torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    want = model(x)
    converted = g8.convert(model)
    assert isinstance(converted[0], nn.Identity)
    assert isinstance(converted[1], g8.LayerNormLinear)
    assert isinstance(converted[3][0], g8.Linear)
    assert_bitwise_equal(converted(x), want)  # outside fp8_autocast: the same math
    with g8.fp8_autocast(recipe=RECIPE):
        for _ in range(3):
            y = converted(x)
    assert sqnr(want.float(), y.float()) > 20.0
    single = g8.convert(nn.Linear(H, H))
    assert isinstance(single, g8.Linear)
