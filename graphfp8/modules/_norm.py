"""LayerNorm / RMSNorm of the LayerNorm* modules: parameters, the high-precision norm (outside
fp8_autocast) and the FP8 norm (under it).

The FP8 norm writes its output straight into the FP8 input slot of the GEMM that follows (the
slot that cast_input would otherwise fill), as a Float8Tensor that the GEMM consumes as is: one
kernel reads x and writes both FP8 layouts, mu and rsigma; its backward is one fused kernel for
dx, dgamma and dbeta. A residual add in front of the norm folds into the same kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from graphfp8 import ops
from graphfp8.fp8.current import AmaxPass, fused
from graphfp8.fp8.observe import StatsSource
from graphfp8.fp8.slots import Quantizer
from graphfp8.fp8.tensor import Float8Tensor

__all__ = ["NORMALIZATIONS", "NormSpec", "apply_norm", "make_norm_params", "norm_fp8"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# amax_pass -> the output slot's quantizer (GemmConfig.quantizer with its role bound).
QuantizerOf = Callable[[AmaxPass], Quantizer]


class NormSpec(NamedTuple):
    """A module's norm: "LayerNorm" or "RMSNorm", eps, and whether the weight is 1 + gamma."""

    normalization: str
    eps: float
    zero_centered_gamma: bool


def make_norm_params(module: nn.Module, size: int, normalization: str, dtype, device,
                     zero_centered_gamma: bool = False) -> None:  # fmt: skip
    """Registers TE-named `layer_norm_weight` (and `layer_norm_bias` for LayerNorm): gamma starts
    at 1, or at 0 with zero_centered_gamma (the weight is then 1 + gamma)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"{type(module).__name__}: normalization must be one of {NORMALIZATIONS}, "
            f"got {normalization!r}"
        )
    init = torch.zeros if zero_centered_gamma else torch.ones
    module.layer_norm_weight = nn.Parameter(init(size, dtype=dtype, device=device))
    if normalization == "LayerNorm":
        module.layer_norm_bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
    else:
        module.register_parameter("layer_norm_bias", None)


def apply_norm(module: nn.Module, x: torch.Tensor, spec: NormSpec) -> torch.Tensor:
    """The norm in high precision (torch's kernels): x (..., size) -> (..., size), same dtype."""
    shape = (x.shape[-1],)
    weight = module.layer_norm_weight
    if spec.zero_centered_gamma:
        weight = weight + 1
    if spec.normalization == "LayerNorm":
        return F.layer_norm(x, shape, weight, module.layer_norm_bias, spec.eps)
    return F.rms_norm(x, shape, weight, spec.eps)


def _amax_pass(x2, res2, gamma, beta, spec: NormSpec, norm) -> AmaxPass:
    """The norm's amax pass under current scaling (graphfp8.fp8.current): the read-only norm
    amax kernel on the fused path, else the norm itself with one layout and its outputs dropped."""
    if not fused(x2.device):
        return lambda q: norm(q, transpose=False, hp=False)
    kw = dict(zero_centered_gamma=spec.zero_centered_gamma, residual=res2)
    if spec.normalization == "LayerNorm":
        return lambda q: ops.layernorm_amax_(x2, gamma, beta, spec.eps, q.amax, **kw)
    return lambda q: ops.rmsnorm_amax_(x2, gamma, spec.eps, q.amax, **kw)


class _NormFP8(torch.autograd.Function):
    """(x, residual) -> (y as a Float8Tensor, y in high precision or None, z = x + residual or
    None), y = norm(z); backward: dz = norm'(dy_fp8 + dy_hp) + dz_residual, to x and residual."""

    @staticmethod
    def forward(ctx, x, residual, gamma, beta, spec: NormSpec, quantizer: QuantizerOf,
                needs_t: bool, hp_out: bool, observe):  # fmt: skip
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        res2 = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()

        def norm(q: Quantizer, transpose: bool = needs_t, hp: bool = hp_out):
            kw = dict(zero_centered_gamma=spec.zero_centered_gamma, transpose=transpose,
                      hp_out=hp, residual=res2)  # fmt: skip
            if spec.normalization == "LayerNorm":
                return ops.layernorm_fp8(x2, gamma, beta, spec.eps, *q, **kw)
            return ops.rmsnorm_fp8(x2, gamma, spec.eps, *q, **kw)

        o = norm(quantizer(_amax_pass(x2, res2, gamma, beta, spec, norm)))
        z = x2 if residual is None else o.residual_out
        if observe is not None:
            mode = "layernorm" if spec.normalization == "LayerNorm" else "rmsnorm"
            observe(lambda: StatsSource(mode, z, mu=o.mu, rsigma=o.rsigma, gamma=gamma, beta=beta,
                                        zero_centered_gamma=spec.zero_centered_gamma))  # fmt: skip
        ctx.save_for_backward(z, gamma, o.mu, o.rsigma)
        ctx.spec, ctx.shape, ctx.has_residual = spec, shape, residual is not None
        y_fp8 = Float8Tensor(o.out.view(shape), o.scale_inv, x.dtype, transpose=o.out_t,
                             transpose_valid=needs_t)  # fmt: skip
        y_hp = o.out_hp.view(shape) if hp_out else None
        return y_fp8, y_hp, (z.view(shape) if residual is not None else None)

    @staticmethod
    def backward(ctx, dy_fp8, dy_hp, dz):
        z, gamma, mu, rsigma = ctx.saved_tensors
        spec: NormSpec = ctx.spec
        hidden = ctx.shape[-1]
        dy = dy_fp8 if dy_hp is None else (dy_hp if dy_fp8 is None else dy_fp8 + dy_hp)
        dy = torch.zeros_like(z) if dy is None else dy.reshape(-1, hidden).contiguous()
        dres = None if dz is None else dz.reshape(-1, hidden).contiguous()
        kw = dict(zero_centered_gamma=spec.zero_centered_gamma, dresidual=dres)
        if spec.normalization == "LayerNorm":
            dx, dgamma, dbeta = ops.layernorm_bwd(dy, z, mu, rsigma, gamma, **kw)
        else:
            (dx, dgamma), dbeta = ops.rmsnorm_bwd(dy, z, rsigma, gamma, **kw), None
        dx = dx.view(ctx.shape)
        return dx, (dx if ctx.has_residual else None), dgamma, dbeta, None, None, None, None, None


def norm_fp8(
    module: nn.Module,
    x: torch.Tensor,
    spec: NormSpec,
    quantizer: QuantizerOf,
    *,
    needs_t: bool,
    hp_out: bool = False,
    residual: torch.Tensor | None = None,
    observe=None,
):
    """The module's norm of x (or of z = x + residual) straight to FP8, in `quantizer`'s slot.

    Args:
        module: owns layer_norm_weight (and layer_norm_bias for LayerNorm), in x's dtype.
        x: (..., hidden) high precision.
        spec: the norm.
        quantizer: amax_pass -> (scale, amax, FP8 dtype) of the slot that the output goes to
            (the next GEMM's FwdRole.INPUT), e.g. partial(cfg.quantizer, FwdRole.INPUT); under
            current scaling it runs amax_pass (the norm's amax pass) first.
        needs_t: also write the transposed FP8 layout (the next GEMM's weight gradient).
        hp_out: also return y in high precision.
        residual: optional (..., hidden) in x's dtype, added to x before the norm.
        observe: optional function taking a function that returns the StatsSource of y: the
            FP8 slot's report to the numerics observer (GemmConfig.observe with its role bound).

    Returns:
        (y_fp8: Float8Tensor (..., hidden), y_hp (..., hidden) or None, z (..., hidden) or None),
        all differentiable.
    """
    return _NormFP8.apply(x, residual, module.layer_norm_weight, module.layer_norm_bias, spec,
                          quantizer, needs_t, hp_out, observe)  # fmt: skip
