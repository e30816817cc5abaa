"""The operands a Float8BlockScaling linear hands torch's blockwise scaled_mm, checked on the CPU:
each of its three GEMMs gives cuBLASLt A row-major and B column-major with the scale layouts torch
checks (its meta kernel runs the same layout checks as CUDA: docs/fp8.md, "Blockwise scaling")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.modules import _blockwise
from graphfp8.ops import blockwise as bw


def _meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _check_operands(a_fp8, a_inv, b_fp8, b_inv) -> None:
    """Strides of scaled_mm_operands' output, then torch's own (meta) checks of them."""
    (m, k), n, kt = a_fp8.shape, b_fp8.shape[0], a_inv.shape[1]
    ops = bw.scaled_mm_operands(a_fp8, a_inv, b_fp8, b_inv)
    mat_a, mat_b, scale_a, _, scale_b, recipe_b = ops
    assert mat_a.shape == (m, k) and mat_a.stride() == (k, 1), "A must be row-major"
    assert mat_b.shape == (k, n) and mat_b.stride() == (1, k), "B must be column-major"
    assert scale_a.shape == (m, kt) and scale_a.stride() == (1, m)
    if recipe_b == F.ScalingType.BlockWise1x128:
        assert scale_b.shape == (n, kt) and scale_b.stride() == (1, n)
    else:
        l4 = -(-kt // 4) * 4
        assert scale_b.shape == (l4, n // 128) and scale_b.stride() == (1, l4)
    out = F.scaled_mm(*[_meta(t) for t in ops], output_dtype=torch.bfloat16)
    assert out.shape == (m, n)
    # The layout copies keep the values (FP8 compared as bytes).
    assert mat_a.view(torch.uint8).equal(a_fp8.view(torch.uint8))
    assert mat_b.t().view(torch.uint8).equal(b_fp8.view(torch.uint8))


@pytest.mark.parametrize("grad_kind", ["dense", "sum"])
def test_the_three_gemms_of_a_linear_hand_cublaslt_its_layouts(monkeypatch, grad_kind):
    """Forward, dgrad and wgrad (whose operands are quantized from transposed views, and whose
    dy is an expanded stride-0 tensor under y.sum()); failed before the quantizers returned
    row-major data (the H200's "Only multiplication of row-major and column-major matrices")."""
    seen = []

    def spy(*args):
        _check_operands(*args[:4])
        seen.append(args[0].shape)
        return bw.blockwise_gemm(*args)

    monkeypatch.setattr(_blockwise, "blockwise_gemm", spy)
    layer = g8.Linear(256, 384, params_dtype=torch.bfloat16)
    x = torch.randn(2, 128, 256, dtype=torch.bfloat16, requires_grad=True)
    with g8.fp8_autocast(recipe=g8.Float8BlockScaling()):
        y = layer(x)
    if grad_kind == "sum":
        y.sum().backward()
    else:
        y.backward(torch.randn_like(y).transpose(0, 1).contiguous().transpose(0, 1))
    assert seen == [(256, 256), (256, 384), (384, 256)]


@pytest.mark.parametrize("b_rows", [1, 128])
def test_quantizers_return_row_major_data_of_transposed_views(b_rows):
    """quantize_tiles / quantize_blocks of x.t() (a column-major view) give row-major FP8 equal
    to the quantization of x.t().contiguous()."""
    x = torch.randn(384, 256, dtype=torch.bfloat16)
    quantize = bw.quantize_tiles if b_rows == 1 else bw.quantize_blocks
    q, inv = quantize(x.t())
    want_q, want_inv = quantize(x.t().contiguous())
    assert q.is_contiguous() and inv.is_contiguous()
    assert q.view(torch.uint8).equal(want_q.view(torch.uint8)) and inv.equal(want_inv)


def test_block_scales_reach_cublaslt_without_a_copy_when_none_is_padded():
    """K / 128 a multiple of 4: scale_b is the weight's block scales as stored (a view; F.pad
    copied them with nothing to pad, a DtoD memcpy per GEMM on the H200: failed before);
    otherwise padded to L4 columns, the same values."""
    for k in (512, 384):
        a_fp8, a_inv = bw.quantize_tiles(torch.randn(128, k))
        b_fp8, b_inv = bw.quantize_blocks(torch.randn(256, k))
        _check_operands(a_fp8, a_inv, b_fp8, b_inv)
        scale_b = bw.scaled_mm_operands(a_fp8, a_inv, b_fp8, b_inv)[4]
        assert (scale_b.data_ptr() == b_inv.data_ptr()) == (k == 512)
        assert torch.equal(scale_b.t()[:, : k // 128], b_inv)
