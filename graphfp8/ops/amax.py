"""Typed wrappers of the amax passes of current scaling: max |f(x)| into an amax, nothing else.

Each computes exactly the values that its cast would quantize (the cast, GELU, dGELU or norm of
graphfp8/ops) and folds only their absolute maximum, NaN ignored: no FP8 bytes, no transpose, no
dbias, no norm statistics. graphfp8/fp8/current.py pairs each with its cast's `scaled_max` form.
"""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["amax_", "dgelu_amax_", "gelu_amax_", "layernorm_amax_", "rmsnorm_amax_"]


@wraps_op("amax")
def amax_(x: torch.Tensor, amax: torch.Tensor, noop: torch.Tensor | None = None) -> None:
    """amax = max(amax, max |x|) in place.

    Args:
        x: (...), float32/bfloat16/float16, contiguous.
        amax: (1,) float32.
        noop: optional (1,) float32 flag; when it holds 1 nothing is read or written.
    """
    ops.amax(x, amax, noop)


@wraps_op("gelu_amax")
def gelu_amax_(x: torch.Tensor, amax: torch.Tensor) -> None:
    """amax = max(amax, max |gelu(x)|), gelu(x) rounded to x.dtype as gelu_cast_transpose casts
    it. x: (...) float32/bfloat16/float16, contiguous; amax: (1,) float32."""
    ops.gelu_amax(x, amax)


@wraps_op("dgelu_amax")
def dgelu_amax_(dy: torch.Tensor, x: torch.Tensor, amax: torch.Tensor) -> None:
    """amax = max(amax, max |dy * gelu'(x)|), as dgelu_cast_transpose_dbias casts it.
    dy, x: (...) of one shape and float dtype, contiguous; amax: (1,) float32."""
    ops.dgelu_amax(dy, x, amax)


@wraps_op("layernorm_amax")
def layernorm_amax_(
    x: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    amax: torch.Tensor,
    *,
    zero_centered_gamma: bool = False,
    residual: torch.Tensor | None = None,
) -> None:
    """amax = max(amax, max |y|) of y = layernorm_fp8's output before quantization.

    Args:
        x, gamma, beta, eps, zero_centered_gamma, residual: as in graphfp8.ops.layernorm_fp8.
        amax: (1,) float32.
    """
    ops.layernorm_amax(x, gamma, beta, eps, zero_centered_gamma, amax, residual)


@wraps_op("rmsnorm_amax")
def rmsnorm_amax_(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    amax: torch.Tensor,
    *,
    zero_centered_gamma: bool = False,
    residual: torch.Tensor | None = None,
) -> None:
    """amax = max(amax, max |y|) of rmsnorm_fp8's y; arguments as in `layernorm_amax_`."""
    ops.rmsnorm_amax(x, gamma, eps, zero_centered_gamma, amax, residual)
