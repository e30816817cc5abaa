"""Per-block statistics of one blockwise FP8 quantization (1x128 tiles or 128x128 blocks: the
numerics report of Float8BlockScaling, graphfp8/numerics_blockwise.py), computed on the device
with torch ops and no host sync, so that a graph captures them.

    x (R, C) high precision, x_fp8 (R, C), scale_inv (ceil(R / rows), ceil(C / 128))
    -> (STATS,) float64: amax, saturated, underflow, nonzero, signal, noise, saturated_blocks,
       underflow_blocks, worst_block_rel_err, log2_scale_min, log2_scale_max, log2_scale_mean

saturated: elements with |x| * scale > fp8_max (scale = 1 / scale_inv), which the cast clamped;
underflow: x != 0 whose FP8 value is 0; a block is saturated / underflowing when any of its
elements is; signal = sum x**2 and noise = sum (x - x_fp8 * scale_inv)**2 (float64);
worst_block_rel_err: the largest sqrt(noise_b / signal_b) over blocks with signal; the log2 of
the block scales (powers of 2 under power_2_scale: whole numbers).

block_stats is torch ops (about 25 launches); blockwise_stats is one kernel (csrc/blockwise.h,
BlockStatsParams) that writes each block's partial sums, gated by a device flag (nothing
written while it holds 0), and reduce_partials turns them into the same STATS: the numerics
report's form, whose captured graphs hold one kernel per quantization, empty while disabled.
"""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["PARTIALS", "STATS", "block_stats", "blockwise_stats", "reduce_partials"]

STATS = ("amax", "saturated", "underflow", "nonzero", "signal", "noise", "saturated_blocks",
         "underflow_blocks", "worst_block_rel_err", "log2_scale_min", "log2_scale_max",
         "log2_scale_mean")  # fmt: skip
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _blocks(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t (R, C) as (blocks_r, rows, blocks_c, 128), zero-padded (zeros count nowhere)."""
    r, c = t.shape
    t = torch.nn.functional.pad(t, (0, -c % 128, 0, -r % rows))
    return t.reshape(t.shape[0] // rows, rows, t.shape[1] // 128, 128)


def block_stats(x: torch.Tensor, x_fp8: torch.Tensor, scale_inv: torch.Tensor,
                rows: int) -> torch.Tensor:  # fmt: skip
    """The STATS of one quantization (module docstring).

    Args:
        x: (R, C) float32/bfloat16/float16, what was quantized.
        x_fp8: (R, C) its FP8 data; scale_inv: (ceil(R / rows), ceil(C / 128)) float32.
        rows: 1 (1x128 tiles) or 128 (128x128 blocks).

    Returns:
        (len(STATS),) float64 on x's device.
    """
    limit = _FP8_MAX[x_fp8.dtype]
    inv = scale_inv.double()[:, None, :, None]
    xb = _blocks(x.double(), rows)
    qb = _blocks(x_fp8.double(), rows)
    sat = (xb.abs() / inv) > limit
    under = (xb != 0) & (qb == 0)
    err2 = (xb - qb * inv).square()
    signal_b, noise_b = xb.square().sum(dim=(1, 3)), err2.sum(dim=(1, 3))
    has_signal = signal_b > 0
    rel = torch.where(has_signal, noise_b / torch.where(has_signal, signal_b, 1.0), 0.0).sqrt()
    log2 = -torch.log2(scale_inv.double())
    return torch.stack([
        xb.abs().amax(), sat.sum().double(), under.sum().double(), (xb != 0).sum().double(),
        signal_b.sum(), noise_b.sum(), sat.any(dim=3).any(dim=1).sum().double(),
        under.any(dim=3).any(dim=1).sum().double(), rel.amax(), log2.amin(), log2.amax(),
        log2.mean(),
    ])  # fmt: skip


PARTIALS = ("amax", "saturated", "underflow", "nonzero", "signal", "noise", "scale_inv")


@wraps_op("blockwise_stats")
def blockwise_stats(x: torch.Tensor, x_fp8: torch.Tensor, scale_inv: torch.Tensor, rows: int,
                    enabled: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Each block's partial sums (PARTIALS) of one quantization into out, unless enabled holds 0.

    Args:
        x, x_fp8, scale_inv, rows: as block_stats (x contiguous).
        enabled: (1,) float32 device flag.
        out: (scale_inv.numel(), len(PARTIALS)) float64, rows in scale_inv's row-major
            order; left as it is while disabled (zeros: "not written", reduce_partials).

    Returns:
        out.
    """
    ops.blockwise_stats(x, x_fp8, scale_inv, rows, enabled, out)
    return out


def reduce_partials(partials: torch.Tensor) -> torch.Tensor:
    """(len(STATS),) float64: block_stats' result from blockwise_stats' partials (zeros for a
    buffer never written; no host sync)."""
    amax, sat, under, nonzero, signal_b, noise_b, inv = partials.unbind(1)
    has_signal = signal_b > 0
    rel = torch.where(has_signal, noise_b / torch.where(has_signal, signal_b, 1.0), 0.0).sqrt()
    log2 = -torch.log2(inv)
    stats = torch.stack([
        amax.amax(), sat.sum(), under.sum(), nonzero.sum(), signal_b.sum(), noise_b.sum(),
        (sat > 0).sum().double(), (under > 0).sum().double(), rel.amax(), log2.amin(),
        log2.amax(), log2.mean(),
    ])  # fmt: skip
    return torch.where((inv > 0).any(), stats, 0.0)  # a written buffer has every scale_inv > 0
