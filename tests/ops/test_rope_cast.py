"""rope_cast_transpose and rope_amax_ (RoPE's backward fused into the QKV gradient's FP8
cast-transpose) against the unfused ops they replace - rope_fp8_backward, then
cast_transpose(_dbias) or amax_ - bit for bit, against their PyTorch twins, and bad input."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.modules.transformer import rope_tables
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import FP8_DTYPES, HP_DTYPES

# (batch, seq, heads, head_dim, kv_heads): every one fits the CUDA kernel (rows % 16 == 0,
# head_dim % 16 == 0); kv_heads < heads is grouped-query attention, head_dim 128 puts a pair's
# halves in different 64-column tiles.
SHAPES = [(2, 24, 2, 16, 2), (2, 8, 4, 32, 1), (1, 16, 3, 64, 3), (2, 16, 2, 128, 2),
          (1, 32, 4, 16, 2)]  # fmt: skip
CPU_SHAPES = [(1, 7, 3, 6, 3), (3, 1, 1, 2, 1)]  # the CPU kernel takes any even head_dim


def _case(shape, dtype, device, tables=True, specials=False):
    b, s, h, d, kv = shape
    gen = torch.Generator().manual_seed(7)
    grads = [fp8_test_data((b, s, n, d), dtype, generator=gen, specials=specials, device=device)
             for n in (h, kv, kv)]  # fmt: skip
    cos, sin = rope_tables(s + 3, d, 500.0, torch.float32, device) if tables else (None, None)
    return grads, cos, sin


def _quantizer(fp8_dtype, device, current=False):
    scale = torch.tensor([0.75], device=device)
    amax = torch.tensor([3.0 if current else 0.5], device=device)
    if current:
        return scale, amax, fp8_dtype, torch.tensor([448.0], device=device)
    return scale, amax, fp8_dtype


def _unfused(grads, cos, sin, heads, quantizer, needs_dbias):
    """What the layer ran before: the fused QKV gradient, then its cast."""
    g = ops.rope_fp8_backward(grads, None, cos, sin, grads[0].dtype).flatten(0, 1)
    if needs_dbias:
        return ops.cast_transpose_dbias(g, *quantizer)
    return (*ops.cast_transpose(g, *quantizer), None)


def _check_same(got, want, got_q, want_q, what):
    names = ["out", "out_t", "scale_inv", "dbias"]
    for name, g, w in zip(names, got, want, strict=True):
        if w is None:
            assert g is None, f"{what}: {name}"
        else:
            assert_bitwise_equal(g, w, f"{what}: {name}")
    for name, g, w in zip(["scale", "amax"], got_q[:2], want_q[:2], strict=True):
        assert_bitwise_equal(g, w, f"{what}: {name}")


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dbias", [True, False])
def test_equals_rope_backward_then_cast(device, dtype, fp8_dtype, shape, dbias):
    grads, cos, sin = _case(shape, dtype, device, specials=True)
    want_q, got_q = _quantizer(fp8_dtype, device), _quantizer(fp8_dtype, device)
    want = _unfused(grads, cos, sin, shape[2], want_q, dbias)
    got = ops.rope_cast_transpose(grads, cos, sin, shape[2], got_q, dbias, shape[4])
    _check_same(got, want, got_q, want_q, f"{shape} {dtype} {fp8_dtype}")


@pytest.mark.parametrize("shape", CPU_SHAPES + SHAPES[:2])
@pytest.mark.parametrize("tables", [True, False])
def test_cpu_shapes_and_no_tables(shape, tables):
    grads, cos, sin = _case(shape, torch.bfloat16, "cpu", tables=tables)
    want_q, got_q = _quantizer(torch.float8_e5m2, "cpu"), _quantizer(torch.float8_e5m2, "cpu")
    want = _unfused(grads, cos, sin, shape[2], want_q, True)
    got = ops.rope_cast_transpose(grads, cos, sin, shape[2], got_q, True, shape[4])
    _check_same(got, want, got_q, want_q, f"{shape} tables={tables}")


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_current_scaling_amax_pass_and_cast(device, dtype, shape):
    """The amax pass is the amax of the rotated gradient; the scaled_max cast then derives the
    scale from it and resets the slot's H[0], as cast_transpose_dbias does."""
    grads, cos, sin = _case(shape, dtype, device, specials=True)
    want_q = _quantizer(torch.float8_e5m2, device, current=True)
    got_q = _quantizer(torch.float8_e5m2, device, current=True)
    g = ops.rope_fp8_backward(grads, None, cos, sin, dtype).flatten(0, 1)
    ops.amax_(g, want_q[1])
    ops.rope_amax_(grads, cos, sin, shape[2], got_q[1], shape[4])
    assert_bitwise_equal(got_q[1], want_q[1], "amax pass")
    want = ops.cast_transpose_dbias(g, *want_q)
    got = ops.rope_cast_transpose(grads, cos, sin, shape[2], got_q, True, shape[4])
    _check_same(got, want, got_q, want_q, f"{shape} {dtype} current")


@pytest.mark.parametrize("shape", SHAPES[:3] + CPU_SHAPES)
def test_matches_twins(shape):
    """The PyTorch twins: every byte, scale_inv and amax bit for bit; dbias (the twin sums in
    torch's order) to fp32 rounding of the bf16 sum."""
    grads, cos, sin = _case(shape, torch.bfloat16, "cpu")
    b, s, h, d, kv = shape
    rows, width = b * s, (h + 2 * kv) * d
    scale = torch.tensor([0.75])
    outs = []
    for fn in (torch.ops.graphfp8.rope_cast_transpose, reference.rope_cast_transpose):
        out = torch.empty(rows, width, dtype=torch.float8_e4m3fn)
        out_t = torch.empty(width, rows, dtype=torch.float8_e4m3fn)
        scale_inv, amax = torch.empty(1), torch.tensor([0.5])
        dbias = torch.empty(width, dtype=grads[0].dtype)
        fn(grads, cos, sin, h, scale, out, out_t, scale_inv, amax, dbias, None, kv)
        only_amax = torch.zeros(1)
        twin = fn is reference.rope_cast_transpose
        (reference.rope_amax if twin else torch.ops.graphfp8.rope_amax)(grads, cos, sin, h,
                                                                        only_amax, kv)  # fmt: skip
        outs.append((out, out_t, scale_inv, amax, dbias, only_amax))
    got, want = outs
    for name, g, w in zip(["out", "out_t", "scale_inv", "amax"], got[:4], want[:4], strict=True):
        assert_bitwise_equal(g, w, name)
    assert_bitwise_equal(got[5], want[5], "rope_amax")
    torch.testing.assert_close(got[4].float(), want[4].float(), rtol=1e-2, atol=1e-2)


def test_bad_input_is_refused():
    grads, cos, sin = _case(SHAPES[0], torch.bfloat16, "cpu")
    q = _quantizer(torch.float8_e4m3fn, "cpu")
    with pytest.raises(RuntimeError, match="contiguous dq, dk, dv of one dtype"):
        ops.rope_cast_transpose([grads[0], grads[1].float(), grads[2]], cos, sin, 2, q, False)
    with pytest.raises(RuntimeError, match="must start with dq"):
        ops.rope_cast_transpose(grads, cos, sin, 3, q, False)
    with pytest.raises(RuntimeError, match="'cos'"):
        ops.rope_cast_transpose(grads, cos[:, :8].contiguous(), sin, 2, q, False)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.rope_amax_([g.to(torch.float8_e4m3fn) for g in grads], cos, sin, 2, torch.zeros(1))


@pytest.mark.parametrize(("shape", "kv_heads", "dtype", "fits"), [
    ((2, 8, 4, 16), 4, torch.bfloat16, True), ((2, 8, 4, 8), 4, torch.bfloat16, False),
    ((2, 8, 4, 8), 2, torch.float32, True), ((1, 7, 4, 16), 4, torch.bfloat16, False),
    ((2, 8, 1, 8), 1, torch.float32, False),  # width 24: not whole 16-column vectors
])  # fmt: skip
def test_fits(shape, kv_heads, dtype, fits):
    assert ops.rope_cast_fits(shape, kv_heads, dtype, "cpu")
    assert ops.rope_cast_fits(shape, kv_heads, dtype, "cuda") is fits
