"""rope_fp8 and rope_fp8_backward against their PyTorch twins (bit for bit), against the unfused
ops they replace, and bad input."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.modules.transformer import rope_tables
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import FP8_DTYPES, HP_DTYPES, poison

# (batch, seq, heads, head_dim, kv_heads): kv_heads < heads is grouped-query attention.
SHAPES = [(2, 24, 2, 16, 2), (1, 7, 3, 6, 3), (3, 1, 1, 2, 1), (2, 9, 2, 128, 2),
          (2, 24, 4, 16, 1), (1, 9, 6, 64, 2)]  # fmt: skip


def _inputs(batch, seq, heads, head_dim, dtype, device, specials=False, kv_heads=None):
    width = (heads + 2 * (kv_heads or heads)) * head_dim
    qkv = fp8_test_data((batch, seq, width), dtype, specials=specials, device=device)
    cos, sin = rope_tables(seq + 3, head_dim, 500.0, torch.float32, device)
    return qkv, cos, sin


def _quantizers(fp8_dtype, device, scales=(0.5, 2.0, 1.0 / 3.0)):
    return [
        (torch.tensor([s], device=device), torch.tensor([0.25 * i], device=device), fp8_dtype)
        for i, s in enumerate(scales)
    ]


def _twin(qkv, cos, sin, heads, quantizers, kv_heads=None):
    b, s, width = qkv.shape
    kv = kv_heads or heads
    d = width // (heads + 2 * kv)
    out = [torch.empty((b, s, h, d), dtype=q[2], device=qkv.device)
           for h, q in zip((heads, kv, kv), quantizers, strict=True)]  # fmt: skip
    scale_inv = [torch.empty(1, device=qkv.device) for _ in range(3)]
    amax = [q[1].clone() for q in quantizers]
    reference.rope_fp8(qkv, cos, sin, heads, [q[0] for q in quantizers], out, scale_inv, amax, kv)
    return out, scale_inv, amax


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tables", [True, False])
def test_forward_matches_twin_bitwise(device, dtype, fp8_dtype, shape, tables):
    *dims, kv = shape
    qkv, cos, sin = _inputs(*dims, dtype, device, specials=True, kv_heads=kv)
    if not tables:
        cos = sin = None
    quantizers = _quantizers(fp8_dtype, device)
    want, want_inv, want_amax = _twin(qkv, cos, sin, shape[2], quantizers, kv)
    got, got_inv = ops.rope_fp8(qkv, cos, sin, shape[2], quantizers, num_kv_heads=kv)
    for part, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"part {part}")
    for g, w in zip(got_inv, want_inv, strict=True):
        assert_bitwise_equal(g, w, "scale_inv")
    for (_, amax, _), w in zip(quantizers, want_amax, strict=True):
        assert_bitwise_equal(amax, w, "amax")


def test_forward_equals_rope_then_casts(device):
    """The fused op is exactly rope_qkv followed by one cast per part."""
    qkv, cos, sin = _inputs(2, 32, 2, 64, torch.bfloat16, device)
    quantizers = _quantizers(torch.float8_e4m3fn, device)
    got, _ = ops.rope_fp8(qkv, cos, sin, 2, quantizers)
    rotated = ops.rope_qkv(qkv, cos, sin, 2).view(2, 32, 3, 2, 64)
    for part, (scale, _, fp8_dtype) in enumerate(quantizers):
        amax = torch.zeros(1, device=device)
        want, _ = ops.cast_to_fp8(rotated[:, :, part].contiguous(), scale, amax, fp8_dtype)
        assert_bitwise_equal(got[part], want, f"part {part}")


def test_every_output_byte_is_written(device):
    qkv, cos, sin = _inputs(2, 16, 2, 32, torch.bfloat16, device)
    quantizers = _quantizers(torch.float8_e4m3fn, device)
    first, _ = ops.rope_fp8(qkv, cos, sin, 2, quantizers)
    for _ in range(2):  # fresh (garbage) buffers each call: equal results mean all were written
        poison(torch.empty(1 << 16, dtype=torch.uint8, device=device))
        again, _ = ops.rope_fp8(qkv, cos, sin, 2, quantizers)
        for a, b in zip(again, first, strict=True):
            assert_bitwise_equal(a, b)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tables", [True, False])
def test_backward_matches_twin_bitwise(device, dtype, fp8_dtype, shape, tables):
    batch, seq, heads, head_dim, kv = shape
    grads = [_grad_with_nans((batch, seq, h, head_dim), fp8_dtype, device) for h in (heads, kv, kv)]
    scale_inv = [torch.tensor([s], device=device) for s in (0.5, 3.0, 1e-3)]
    cos, sin = rope_tables(seq + 2, head_dim, 500.0, torch.float32, device)
    if not tables:
        cos = sin = None
    want = torch.empty(batch, seq, (heads + 2 * kv) * head_dim, dtype=dtype, device=device)
    reference.rope_fp8_backward(grads, scale_inv, cos, sin, heads, want, kv)
    if device != "cpu":
        assert torch.isnan(want).any()  # the NaN encodings are under test too
    assert_bitwise_equal(ops.rope_fp8_backward(grads, scale_inv, cos, sin, dtype), want)


def _grad_with_nans(shape, fp8_dtype, device) -> torch.Tensor:
    """Random FP8 data; on CUDA also a NaN code of each sign at fixed places, so every case meets
    NaN inputs: the kernel must write the NaN bits torch's CUDA conversion writes (the CUDA
    kernels once wrote the CPU's 0x7FC0 for bf16 where CUDA writes 0x7FFF). Not on the CPU:
    torch's vectorised CPU conversions write ISA-dependent NaNs (on x86 0xFFFF for bf16,
    payload-keeping for fp16) that the CPU kernels, converting one element at a time, do not
    reproduce; CPU data has no NaN codes (the CPU's E4M3 cast of an overflow saturates)."""
    g = fp8_test_data(shape, torch.float32, device=device).to(fp8_dtype)
    if device != "cpu":
        bits = g.view(torch.uint8).view(-1)
        bits[0], bits[-1] = 0x7F, 0xFF
    return g


def test_backward_is_the_transposed_rotation(device):
    """<rope(x), g> == <x, rope_fp8_backward(g)> up to float32 rounding (scale_inv 1): the
    identity the attention backward relies on."""
    x = torch.randn(1, 16, 3 * 2 * 16, device=device)
    cos, sin = rope_tables(16, 16, 500.0, torch.float32, device)
    g = [torch.randn(1, 16, 2, 16, device=device).to(torch.float8_e5m2) for _ in range(3)]
    ones = [torch.ones(1, device=device)] * 3
    back = ops.rope_fp8_backward(g, ones, cos, sin, torch.float32)
    rotated = ops.rope_qkv(x, cos, sin, 2).view(1, 16, 3, 2, 16)
    lhs = sum((rotated[:, :, i].double() * g[i].double()).sum() for i in range(3))
    rhs = (x.double() * back.double()).sum()
    torch.testing.assert_close(rhs, lhs, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, c, s, h: (q.to(torch.int32), c, s, h), TypeError, "float32, bfloat16"),
        (lambda q, c, s, h: (q[0], c, s, h), ValueError, r"\(batch, seq, 3 \* hidden\)"),
        (lambda q, c, s, h: (q, c, s, 5), ValueError, r"is not \(num_heads \+ 2"),
        (lambda q, c, s, h: (q, c[:4], s, h), ValueError, "argument 'cos' must be"),
        (lambda q, c, s, h: (q, c, None, h), ValueError, "given together"),
        (lambda q, c, s, h: (q, c, s.double(), h), TypeError, "argument 'sin' must be float32"),
        (lambda q, c, s, h: (q.transpose(0, 1), c, s, h), ValueError, "contiguous"),
    ],
)
def test_errors(device, change, error, match):
    qkv, cos, sin = _inputs(2, 16, 2, 8, torch.bfloat16, device)
    with pytest.raises(error, match=match):
        ops.rope_fp8(*change(qkv, cos, sin, 2), _quantizers(torch.float8_e4m3fn, device))


def test_gqa_equals_rope_then_casts(device):
    """With kv_heads < heads the fused op is rope_qkv (same layout) then one cast per part, and
    its backward is rope_qkv's inverse of the dequantized gradients."""
    b, s, h, g, d = 2, 16, 4, 2, 32
    qkv, cos, sin = _inputs(b, s, h, d, torch.bfloat16, device, kv_heads=g)
    quantizers = _quantizers(torch.float8_e4m3fn, device)
    got, inv = ops.rope_fp8(qkv, cos, sin, h, quantizers, num_kv_heads=g)
    assert [t.shape[2] for t in got] == [h, g, g]
    rotated = ops.rope_qkv(qkv, cos, sin, h, num_kv_heads=g).view(b, s, h + 2 * g, d)
    for part, (lo, hi) in enumerate(((0, h), (h, h + g), (h + g, h + 2 * g))):
        scale, _, fp8_dtype = quantizers[part]
        want, _ = ops.cast_to_fp8(rotated[:, :, lo:hi].contiguous(), scale, torch.zeros(1,
                                  device=device), fp8_dtype)  # fmt: skip
        assert_bitwise_equal(got[part], want, f"part {part}")
    back = ops.rope_fp8_backward(got, inv, cos, sin, torch.float32)
    packed = torch.cat([t.float() * si for t, si in zip(got, inv, strict=True)], dim=2)
    want = ops.rope_qkv(packed.reshape(b, s, -1), cos, sin, h, inverse=True, num_kv_heads=g)
    assert_bitwise_equal(back, want)


def test_mixed_fp8_dtypes_rejected(device):
    qkv, cos, sin = _inputs(2, 16, 2, 8, torch.bfloat16, device)
    quantizers = _quantizers(torch.float8_e4m3fn, device)
    quantizers[2] = (*quantizers[2][:2], torch.float8_e5m2)
    with pytest.raises(ValueError, match="one FP8 dtype"):
        ops.rope_fp8(qkv, cos, sin, 2, quantizers)


def test_op_checks_too(device):
    """The dispatcher op repeats the checks for direct torch.ops calls."""
    qkv, cos, sin = _inputs(2, 16, 2, 8, torch.bfloat16, device)
    scales = [torch.ones(1, device=device)] * 3
    out = [torch.empty(2, 16, 2, 8, dtype=torch.float8_e4m3fn, device=device) for _ in range(3)]
    one = [torch.empty(1, device=device) for _ in range(3)]
    with pytest.raises(RuntimeError, match="must have shape"):
        wrong = torch.empty(2, 8, 2, 8, dtype=torch.float8_e4m3fn, device=device)
        torch.ops.graphfp8.rope_fp8(qkv, cos, sin, 2, scales, out[:2] + [wrong], one, one)
    with pytest.raises(RuntimeError, match="must hold 3 tensors"):
        torch.ops.graphfp8.rope_fp8(qkv, cos, sin, 2, scales[:2], out, one, one)
    dqkv = torch.empty_like(qkv)
    with pytest.raises(RuntimeError, match="given together"):
        torch.ops.graphfp8.rope_fp8_backward(out, one, cos, None, 2, dqkv)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tables", [True, False])
def test_high_precision_backward_is_the_cat_and_rope_qkv(device, dtype, shape, tables):
    """dq, dk, dv of the bf16 attention path: rope_fp8_backward without scale_inv equals
    rope_qkv(cat(dq, dk, dv), inverse) (and the twin) bit for bit: one kernel for the two. (A NaN
    gradient stays NaN; its payload bits are the float conversion's, which the cat kept.)"""
    batch, seq, heads, head_dim, kv = shape
    grads = [fp8_test_data((batch, seq, h, head_dim), dtype, device=device)
             for h in (heads, kv, kv)]  # fmt: skip
    cos, sin = rope_tables(seq + 2, head_dim, 500.0, torch.float32, device)
    packed = torch.cat(grads, dim=2).reshape(batch, seq, -1)
    if tables:
        want = ops.rope_qkv(packed, cos, sin, heads, inverse=True, num_kv_heads=kv)
    else:
        cos = sin = None
        want = packed
    twin = torch.empty_like(want)
    reference.rope_fp8_backward(grads, [], cos, sin, heads, twin, kv)
    got = ops.rope_fp8_backward(grads, None, cos, sin, dtype)
    assert_bitwise_equal(got, want, "vs the cat and rope_qkv")
    assert_bitwise_equal(got, twin, "vs the twin")


def test_high_precision_backward_refuses_scales_or_another_dtype(device):
    g = [torch.randn(1, 4, 2, 8, device=device, dtype=torch.bfloat16) for _ in range(3)]
    ones = [torch.ones(1, device=device)] * 3
    with pytest.raises(TypeError, match="without"):
        ops.rope_fp8_backward(g, ones, None, None, torch.bfloat16)
    with pytest.raises(TypeError, match="of dtype torch.float32"):
        ops.rope_fp8_backward(g, None, None, None, torch.float32)
    out = torch.empty(1, 4, 48, device=device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="take no 'scale_inv'"):
        torch.ops.graphfp8.rope_fp8_backward(g, ones, None, None, 2, out, 2)
    with pytest.raises(RuntimeError, match="must have out's dtype"):
        torch.ops.graphfp8.rope_fp8_backward([t.float() for t in g], [], None, None, 2, out, 2)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_rope_parts_function_equals_rope_then_split(device, kv_heads):
    """modules/_rope.RopeQKVParts (the bf16 attention path under ROPE_PARTS_BWD, always on the
    CPU) against RopeQKV and a split of its output (whose backward cats dq, dk, dv): the same
    q, k, v and the same qkv gradient through torch's attention, bit for bit."""
    from graphfp8.modules._rope import RopeQKV, RopeQKVParts  # noqa: PLC0415

    b, s, h, d = 2, 16, 4, 32
    qkv = torch.randn(b, s, (h + 2 * kv_heads) * d, device=device, dtype=torch.bfloat16)
    cos, sin = rope_tables(s, d, 500.0, torch.float32, device)

    def run(parts: bool):
        x = qkv.clone().requires_grad_(True)
        if parts:
            q, k, v = RopeQKVParts.apply(x, cos, sin, h, kv_heads)
        else:
            rotated = RopeQKV.apply(x, cos, sin, h, kv_heads)
            q, k, v = rotated.view(b, s, -1, d).split([h, kv_heads, kv_heads], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=kv_heads != h)  # fmt: skip
        out.float().square().sum().backward()
        return [q, k, v, x.grad]

    for i, (got, want) in enumerate(zip(run(True), run(False), strict=True)):
        assert_bitwise_equal(got, want, f"output {i}")
