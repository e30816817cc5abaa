"""The norm and the MLP activation of blockwise layers as graphfp8 kernels in the input dtype
(docs/fp8.md, "Blockwise scaling"), under the switch GRAPHFP8_BLOCKWISE_GLU_KERNEL (on by default
since its H200 run; off: `PLAIN.on = False`, or GRAPHFP8_BLOCKWISE_GLU_KERNEL=0).

Off, a blockwise LayerNormMLP / LayerNormLinear runs torch's norm and, for the MLP, torch's
activation ops (chunk, silu, the products; in the backward their gradients and a cat), and the
GEMMs quantize the results (modules/_blockwise.py). On:

    norm        z = x (+ residual);  y = ops.rmsnorm_fp8 / layernorm_fp8's high-precision output
                backward: ops.rmsnorm_bwd / layernorm_bwd (dx, dgamma, dbeta; dresidual added)
    activation  a = ops.mlp_act(h) (rows, F) from fc1's output h (rows, F or 2 F)
                backward: dh = ops.mlp_dact(da, h), [dg | du] written side by side, one pass

and fc1 / fc2 quantize y and a as before. GRAPHFP8_BLOCKWISE_NORM and GRAPHFP8_BLOCKWISE_ACT, when
on, take precedence (their kernels write the GEMMs' tiles themselves). The values are the
kernels' roundings (glu_math.h's activation, the norm kernel's y), not torch's, so the switch
changes a blockwise layer's results in their last bits; eager and graphed runs take the same
kernels (graphed == eager either way). The norm kernel also writes an FP8 copy of y at
scale 1, dropped (1 byte per element; the kernel has no output without it).
"""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.modules._context import blockwise_recipe
from graphfp8.modules._norm import NormSpec
from graphfp8.ops.mlp_act import MLP_ACTIVATIONS
from graphfp8.ops.switches import env_switch

__all__ = ["PLAIN", "plain_act", "plain_norm", "plain_on"]


class _Switch:
    """GRAPHFP8_BLOCKWISE_GLU_KERNEL, read at import; `PLAIN.on` may be changed at run time."""

    def __init__(self) -> None:
        self.on = env_switch("BLOCKWISE_GLU_KERNEL")


PLAIN = _Switch()


def plain_on() -> bool:
    """Whether a blockwise layer runs this module's kernels now: blockwise FP8 on and the switch
    on (high precision outside fp8_autocast keeps torch's ops). The recipe alone decides, not
    the layer's weight configs (None for FP8 primary weights, whose blocks need no cache), so a
    model with FP8 primary weights takes the same kernels as its high-precision twin."""
    return PLAIN.on and blockwise_recipe() is not None


class _PlainAct(torch.autograd.Function):
    """a = act(h) and dh = act'(h) da by ops.mlp_act / mlp_dact; saves h (fc1's output)."""

    @staticmethod
    def forward(fn_ctx, h, activation: str):
        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        a = ops.mlp_act(h2, activation)
        fn_ctx.save_for_backward(h2)
        fn_ctx.activation, fn_ctx.h_shape = activation, h.shape
        return a.view(*h.shape[:-1], a.shape[-1])

    @staticmethod
    def backward(fn_ctx, da):
        (h2,) = fn_ctx.saved_tensors
        da2 = da.reshape(h2.shape[0], -1).contiguous()
        return ops.mlp_dact(da2, h2, fn_ctx.activation).view(fn_ctx.h_shape), None


def plain_act(h: torch.Tensor, activation: str, torch_act) -> torch.Tensor:
    """act(h) by ops.mlp_act for the activations it has ("gelu", "swiglu", "geglu"), else
    torch_act(h) (relu).

    Args:
        h: (..., F) for "gelu", (..., 2 F) = [g | u] for the gated ones: fc1's output.
        activation: the layer's activation name; torch_act: its torch form.

    Returns:
        (..., F) in h's dtype, differentiable in h.
    """
    if activation not in MLP_ACTIVATIONS:
        return torch_act(h)
    return _PlainAct.apply(h, activation)


class _PlainNorm(torch.autograd.Function):
    """(x, residual) -> (y, z = x + residual or None), y = norm(z) by the norm kernels."""

    @staticmethod
    def forward(fn_ctx, x, residual, gamma, beta, spec: NormSpec):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        res2 = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
        scale_amax = torch.ones(2, dtype=torch.float32, device=x.device)  # the dropped FP8 y's
        q = (scale_amax[:1], scale_amax[1:], torch.float8_e4m3fn)
        kw = dict(zero_centered_gamma=spec.zero_centered_gamma, hp_out=True, residual=res2)
        if spec.normalization == "LayerNorm":
            o = ops.layernorm_fp8(x2, gamma, beta, spec.eps, *q, **kw)
        else:
            o = ops.rmsnorm_fp8(x2, gamma, spec.eps, *q, **kw)
        z = x2 if residual is None else o.residual_out
        fn_ctx.save_for_backward(z, gamma, o.mu, o.rsigma)
        fn_ctx.spec, fn_ctx.shape, fn_ctx.has_residual = spec, shape, residual is not None
        return o.out_hp.view(shape), (z.view(shape) if residual is not None else None)

    @staticmethod
    def backward(fn_ctx, dy, dz):
        z, gamma, mu, rsigma = fn_ctx.saved_tensors
        spec: NormSpec = fn_ctx.spec
        dy = dy.reshape(z.shape).contiguous()
        dres = None if dz is None else dz.reshape(z.shape).contiguous()
        kw = dict(zero_centered_gamma=spec.zero_centered_gamma, dresidual=dres)
        if mu is not None:
            dx, dgamma, dbeta = ops.layernorm_bwd(dy, z, mu, rsigma, gamma, **kw)
        else:
            (dx, dgamma), dbeta = ops.rmsnorm_bwd(dy, z, rsigma, gamma, **kw), None
        dx = dx.view(fn_ctx.shape)
        return dx, (dx if fn_ctx.has_residual else None), dgamma, dbeta, None


def plain_norm(module, x: torch.Tensor, residual: torch.Tensor | None, spec: NormSpec,
               torch_norm) -> tuple:  # fmt: skip
    """The module's norm of x (or of h = x + residual) by the norm kernels, in x's dtype; where
    the kernels cannot take it (the norm weights in another dtype than x), torch_norm(module, h,
    spec), the switch-off path.

    Args:
        module: owns layer_norm_weight (and layer_norm_bias for LayerNorm).
        x: (..., K) high precision; residual: like x, or None.
        spec: the norm; torch_norm: modules/_norm.apply_norm.

    Returns:
        (y (..., K) in x's dtype, h (..., K) or None without a residual), differentiable.
    """
    gamma, beta = module.layer_norm_weight, module.layer_norm_bias
    same = gamma.dtype == x.dtype and (beta is None or beta.dtype == x.dtype)
    if not same or (residual is not None and residual.dtype != x.dtype):
        h = x if residual is None else x + residual
        return torch_norm(module, h, spec), (None if residual is None else h)
    return _PlainNorm.apply(x, residual, gamma, beta, spec)
