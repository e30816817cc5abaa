"""Typed wrapper of the FP8 cast statistics kernel (graphfp8.numerics' device half).

    out (partials, 8) float64 = per work unit: max |hp|, #saturated, #underflow, #nonzero,
                                sum hp^2, sum (hp - dequantized)^2, scale, recorded amax

hp is the tensor a cast quantized: x itself, or recomputed in the fused kernels' arithmetic
(csrc/cast_stats.h has the modes). `reduce_cast_stats` folds the rows in a fixed order.
"""

from __future__ import annotations

import functools

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["STATS_COLUMNS", "STATS_MODES", "cast_stats", "reduce_cast_stats", "stats_partials"]

STATS_MODES = {"identity": 0, "gelu": 1, "dgelu": 2, "layernorm": 3, "rmsnorm": 4}
STATS_COLUMNS = ("amax", "saturated", "underflow", "nonzero", "signal", "noise", "scale",
                 "recorded_amax")  # fmt: skip


@functools.cache
def _cuda_partials(index: int) -> int:
    return 4 * torch.cuda.get_device_properties(index).multi_processor_count


def stats_partials(device) -> int:
    """Rows of `cast_stats`' output on `device`: 1 on the CPU, 4 per multiprocessor on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return _cuda_partials(device.index if device.index is not None else torch.cuda.current_device())


@wraps_op("cast_stats")
def cast_stats(
    x: torch.Tensor,
    scale: torch.Tensor,
    recorded_amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    mode: str = "identity",
    act_in: torch.Tensor | None = None,
    mu: torch.Tensor | None = None,
    rsigma: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    zero_centered_gamma: bool = False,
    enabled: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Statistics of one FP8 cast, on x's device, without a host sync.

    Args:
        x: (..., cols) float32/bfloat16/float16, contiguous: the cast's input (the GELU input for
            "gelu", dy for "dgelu", the norm input z, 2-D (rows, cols), for the norms).
        scale: (1,) float32, the scale of the cast; recorded_amax: (1,) float32, its slot's amax.
        fp8_dtype: the cast's format.
        mode: "identity", "gelu", "dgelu", "layernorm" or "rmsnorm".
        act_in: "dgelu": the GELU input, like x. mu: "layernorm": (rows,) float32.
        rsigma: norms: (rows,) float32. gamma: norms: (cols,) x's dtype; beta: "layernorm".
        zero_centered_gamma: norms: the weight is 1 + gamma.
        enabled: optional (1,) float32 device flag: 0 writes nothing (for captured graphs).
        skip: optional (1,) float32 noop flag of a weight cast: 1 writes nothing.
        out: optional (stats_partials(device), 8) float64 destination.

    Returns:
        out, (partials, 8) float64 (`reduce_cast_stats` folds it).
    """
    if mode not in STATS_MODES:
        raise ValueError(f"graphfp8.cast_stats: mode must be one of {sorted(STATS_MODES)}, "
                         f"got {mode!r}")  # fmt: skip
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"graphfp8.cast_stats: fp8_dtype must be an FP8 dtype, got {fp8_dtype}")
    if out is None:
        out = torch.zeros(stats_partials(x.device), len(STATS_COLUMNS), dtype=torch.float64,
                          device=x.device)  # fmt: skip
    ops.cast_stats(x, act_in, mu, rsigma, gamma, beta, STATS_MODES[mode], zero_centered_gamma,
                   scale, recorded_amax, fp8_dtype == torch.float8_e4m3fn, enabled, skip,
                   out)  # fmt: skip
    return out


def reduce_cast_stats(partials: torch.Tensor) -> torch.Tensor:
    """(..., P, 8) rows of cast_stats -> (..., 8): the max of the amax column, the sums of the
    counts and sums, the scale and recorded amax of row 0."""
    amax = partials[..., 0].amax(dim=-1, keepdim=True)
    sums = partials[..., 1:6].sum(dim=-2)
    return torch.cat([amax, sums, partials[..., 0, 6:8]], dim=-1)
