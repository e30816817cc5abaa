"""The per-block statistics kernel of the blockwise numerics report (graphfp8.ops.blockwise_stats,
csrc/blockwise.h BlockStatsParams) against its twin (reference.blockwise_stats: counts, amax and
scales exactly, the float64 sums to rounding) and, reduced by reduce_partials, against the torch
ops of block_stats: 1x128 tiles and 128x128 blocks, partial tiles, zero tiles, underflow,
saturation, NaN; nothing written while the flag holds 0; on CUDA the same, and captured."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.ops import blockwise
from graphfp8.ops.blockwise_stats import PARTIALS, STATS, block_stats, reduce_partials
from tests.helpers import HAS_CUDA

EXACT = [0, 1, 2, 3, 6]  # amax, saturated, underflow, nonzero, scale_inv


def _input(shape=(272, 400), dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Outliers, a zero block, underflowing values and partial tiles both ways (shape at least
    (256, 384))."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[5] *= 1e4
    x[128:256, 256:384] = 0.0
    x[:128, :128] *= 1e-3
    x[:128, 0] = 1.0
    return x.to(dtype)


def _quantized(x, rows, stale=False):
    x_fp8, inv = blockwise.quantize(x, rows)
    return x_fp8, inv / 4 if stale else inv  # a stale 4x larger scale saturates


def _partials(x, x_fp8, inv, rows, enabled=1.0):
    out = torch.full((inv.numel(), len(PARTIALS)), -1.0, dtype=torch.float64, device=x.device)
    flag = torch.full((1,), enabled, device=x.device)
    return ops.blockwise_stats(x, x_fp8, inv, rows, flag, out)


@pytest.mark.parametrize("rows", [1, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("stale", [False, True])
def test_kernel_equals_the_twin(device, rows, dtype, stale):
    x = _input(dtype=dtype).to(device)
    x[7, 9] = float("nan")
    x_fp8, inv = _quantized(x, rows, stale)
    got = _partials(x, x_fp8, inv, rows)
    want = torch.full_like(got, -1.0)
    reference.blockwise_stats(x, x_fp8, inv, rows, torch.ones(1, device=device), want)
    assert torch.equal(got[:, EXACT].nan_to_num(-2.0), want[:, EXACT].nan_to_num(-2.0))
    assert got[:, 0].isnan().sum() == 1  # the NaN's tile or block only
    torch.testing.assert_close(got[:, 4:6], want[:, 4:6], rtol=1e-12, atol=0.0, equal_nan=True)
    if stale:
        assert got[:, 1].sum() > 0


@pytest.mark.parametrize("rows", [1, 128])
def test_reduced_partials_equal_block_stats(device, rows):
    x = _input().to(device)
    x_fp8, inv = _quantized(x, rows)
    got = dict(zip(STATS, reduce_partials(_partials(x, x_fp8, inv, rows)).tolist(), strict=True))
    want = dict(zip(STATS, block_stats(x, x_fp8, inv, rows).tolist(), strict=True))
    for name in STATS:
        assert got[name] == pytest.approx(want[name], rel=1e-12), name
    assert got["underflow_blocks"] > 0


def test_disabled_writes_nothing_and_unwritten_reduces_to_zeros(device):
    x = _input().to(device)
    x_fp8, inv = _quantized(x, 1)
    got = _partials(x, x_fp8, inv, 1, enabled=0.0)
    assert got.eq(-1.0).all()
    assert reduce_partials(torch.zeros_like(got)).eq(0).all()


def test_argument_checks():
    x = torch.randn(4, 256)
    x_fp8, inv = _quantized(x, 1)
    out = torch.zeros(inv.numel(), len(PARTIALS), dtype=torch.float64)
    with pytest.raises(RuntimeError, match="'out' must be float64"):
        ops.blockwise_stats(x, x_fp8, inv, 1, torch.ones(1), out.float())
    with pytest.raises(RuntimeError, match="'scale_inv' must have shape"):
        ops.blockwise_stats(x, x_fp8, inv, 128, torch.ones(1), out)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 128])
def test_cuda_kernel_equals_the_cpu_kernel(rows):
    """Counts, amax and scales exactly; the sums (a tree over the columns) to rounding."""
    x = _input((1000, 700), seed=4)
    x_fp8, inv = _quantized(x, rows)
    cpu = _partials(x, x_fp8, inv, rows)
    gpu = _partials(x.cuda(), x_fp8.cuda(), inv.cuda(), rows).cpu()
    assert torch.equal(gpu[:, EXACT], cpu[:, EXACT])
    torch.testing.assert_close(gpu[:, 4:6], cpu[:, 4:6], rtol=1e-12, atol=0.0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_kernel_in_a_cuda_graph():
    """Captured: the flag read at replay (0: nothing written)."""
    x = _input((512, 1024)).cuda()
    x_fp8, inv = _quantized(x, 1)
    out = torch.full((inv.numel(), len(PARTIALS)), -1.0, dtype=torch.float64, device="cuda")
    flag = torch.zeros(1, device="cuda")
    ops.blockwise_stats(x, x_fp8, inv, 1, flag, out)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.blockwise_stats(x, x_fp8, inv, 1, flag, out)
    graph.replay()
    assert out.eq(-1.0).all()
    flag.fill_(1)
    graph.replay()
    assert torch.equal(out, _partials(x, x_fp8, inv, 1))
