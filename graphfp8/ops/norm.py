"""Typed wrappers of the norm kernels: LayerNorm / RMSNorm straight to FP8, and their backward.

    forward   z = x (or x + residual, rounded: a residual add folded into the norm)
              y = norm(z) * g (+ beta), g = gamma (+ 1 with zero_centered_gamma)
              out = saturate(y * scale) FP8, out_t = out^T, amax, scale_inv, mu, rsigma
    backward  dx = norm'(z)^T (dy * g) (+ dresidual), dgamma = sum_rows dy xhat, dbeta = sum_rows dy

The exact rounding of every step is in csrc/common.h (NormParams, NormBwdParams) and in the
twins of graphfp8/reference.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["NormFP8", "layernorm_fp8", "rmsnorm_fp8", "layernorm_bwd", "rmsnorm_bwd"]


class NormFP8(NamedTuple):
    """A norm's outputs.

    out: (rows, hidden) FP8; out_t: (hidden, rows) FP8 or None; scale_inv: (1,) float32;
    mu: (rows,) float32 (LayerNorm) or None; rsigma: (rows,) float32; out_hp: (rows, hidden) in
    x's dtype or None; residual_out: z = x + residual (rows, hidden) in x's dtype, or None.
    """

    out: torch.Tensor
    out_t: torch.Tensor | None
    scale_inv: torch.Tensor
    mu: torch.Tensor | None
    rsigma: torch.Tensor
    out_hp: torch.Tensor | None
    residual_out: torch.Tensor | None


def _outputs(x, fp8_dtype, transpose: bool, hp_out: bool, residual, layernorm: bool, what: str):
    if x.dim() != 2:
        raise ValueError(f"graphfp8.{what}: argument 'x' must be 2-D (rows, hidden), got "
                         f"{x.dim()}-D")  # fmt: skip
    rows, hidden = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    return NormFP8(
        out=torch.empty(rows, hidden, dtype=fp8_dtype, device=x.device),
        out_t=torch.empty(hidden, rows, dtype=fp8_dtype, device=x.device) if transpose else None,
        scale_inv=torch.empty(1, **f32),
        mu=torch.empty(rows, **f32) if layernorm else None,
        rsigma=torch.empty(rows, **f32),
        out_hp=torch.empty_like(x) if hp_out else None,
        residual_out=torch.empty_like(x) if residual is not None else None,
    )


@wraps_op("layernorm_fp8")
def layernorm_fp8(
    x: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    scaled_max: torch.Tensor | None = None,
    *,
    zero_centered_gamma: bool = False,
    transpose: bool = False,
    hp_out: bool = False,
    residual: torch.Tensor | None = None,
) -> NormFP8:
    """LayerNorm of each row of x, written as FP8 in one pass (amax and scale_inv fused).

    Args:
        x: (rows, hidden), float32/bfloat16/float16, contiguous.
        gamma, beta: (hidden,) in x's dtype.
        eps: added to the variance.
        scale: (1,) float32: out = saturate(y * scale).
        amax: (1,) float32, updated in place to max(amax, max|y|) (NaNs ignored).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        scaled_max: optional (1,) float32: current scaling computed by the norm (amax is then
            the slot's H[0] from `layernorm_amax`, read and reset; graphfp8.ops.cast_to_fp8).
        zero_centered_gamma: the weight is 1 + gamma (gamma starts at zero).
        transpose: also write out_t = out^T (hidden, rows), for a weight-gradient GEMM.
        hp_out: also write y in x's dtype.
        residual: optional (rows, hidden) in x's dtype: normalize z = x + residual (rounded to
            x's dtype) and return z as residual_out.

    Returns:
        NormFP8 (mu and rsigma (rows,) float32 for the backward).
    """
    o = _outputs(x, fp8_dtype, transpose, hp_out, residual, True, "layernorm_fp8")
    ops.layernorm_fp8(x, gamma, beta, eps, zero_centered_gamma, scale, o.out, o.out_t,
                      o.scale_inv, amax, o.mu, o.rsigma, o.out_hp, residual,
                      o.residual_out, scaled_max)  # fmt: skip
    return o


@wraps_op("rmsnorm_fp8")
def rmsnorm_fp8(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    scaled_max: torch.Tensor | None = None,
    *,
    zero_centered_gamma: bool = False,
    transpose: bool = False,
    hp_out: bool = False,
    residual: torch.Tensor | None = None,
) -> NormFP8:
    """RMSNorm of each row of x written as FP8: y = x / sqrt(mean(x^2) + eps) * g. Arguments and
    result as in `layernorm_fp8` (no beta; mu is None)."""
    o = _outputs(x, fp8_dtype, transpose, hp_out, residual, False, "rmsnorm_fp8")
    ops.rmsnorm_fp8(x, gamma, eps, zero_centered_gamma, scale, o.out, o.out_t, o.scale_inv, amax,
                    o.rsigma, o.out_hp, residual, o.residual_out, scaled_max)  # fmt: skip
    return o


@wraps_op("layernorm_bwd")
def layernorm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    mu: torch.Tensor,
    rsigma: torch.Tensor,
    gamma: torch.Tensor,
    *,
    zero_centered_gamma: bool = False,
    dresidual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LayerNorm backward: dx, dgamma and dbeta in one pass over dy and x (plus a
    deterministic column reduction on the GPU: no atomics).

    Args:
        dy: (rows, hidden) in x's dtype: the gradient of y.
        x: (rows, hidden): the input that the forward normalized (z, with a residual).
        mu, rsigma: (rows,) float32 from the forward.
        gamma: (hidden,) in x's dtype.
        zero_centered_gamma: as in the forward.
        dresidual: optional (rows, hidden): a gradient that reaches z by another path, added
            to dx.

    Returns:
        (dx (rows, hidden), dgamma (hidden,), dbeta (hidden,)), all in x's dtype.
    """
    dx, dgamma, dbeta = torch.empty_like(x), torch.empty_like(gamma), torch.empty_like(gamma)
    ops.layernorm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, dx, dgamma, dbeta, dresidual)
    return dx, dgamma, dbeta


@wraps_op("rmsnorm_bwd")
def rmsnorm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    rsigma: torch.Tensor,
    gamma: torch.Tensor,
    *,
    zero_centered_gamma: bool = False,
    dresidual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm backward: (dx, dgamma), arguments as in `layernorm_bwd` (no mu, no dbeta)."""
    dx, dgamma = torch.empty_like(x), torch.empty_like(gamma)
    ops.rmsnorm_bwd(dy, x, rsigma, gamma, zero_centered_gamma, dx, dgamma, dresidual)
    return dx, dgamma
