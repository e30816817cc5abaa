"""A norm followed by a linear GEMM under Float8BlockScaling, the norm writing the GEMM's
blockwise FP8 input itself (graphfp8.ops.blockwise_norm: y's 1x128 tiles along K and y.T's along
the tokens from one op, no high-precision y written on CUDA), as the per-tensor path's norm
writes its FP8 input (modules/_norm.py). LayerNormLinear and LayerNormMLP (its fc1) run it under
the switch GRAPHFP8_BLOCKWISE_NORM (off by default until its CUDA kernel has run on a GPU;
docs/fp8.md, "Blockwise scaling"); off, they run torch's norm and quantize its output at the GEMM
(modules/_blockwise.py).

    forward   y_q = blockwise_norm(x [+ residual]);  out = y_q @ w.T (+ b)
    backward  dy_norm = dy @ w (blockwise dgrad), dw = dy.T @ y.T's tiles, the norm backward
              kernel for dx, dgamma, dbeta (dresidual: the gradient of the returned h)

Bit for bit, the fused norm is the norm kernel's output rounded to x's dtype, then quantized;
torch's F.layer_norm / F.rms_norm round differently, so the switch changes a blockwise layer's
results by that rounding (both settings give graphed == eager).
"""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.fp8.observe import observe_block
from graphfp8.fp8.weight_cache import BlockWeight
from graphfp8.modules._blockwise import _transposed, _weight_blocks
from graphfp8.modules._context import blockwise_recipe
from graphfp8.modules._norm import NormSpec
from graphfp8.ops.blockwise import blockwise_gemm, quantize
from graphfp8.ops.switches import env_switch

__all__ = ["FUSED", "fused_norm_linear", "norm_linear"]

_E4M3 = torch.float8_e4m3fn


class _Switch:
    """GRAPHFP8_BLOCKWISE_NORM, read at import; `FUSED.on` may be changed at run time."""

    def __init__(self) -> None:
        self.on = env_switch("BLOCKWISE_NORM")


FUSED = _Switch()


def fused_norm_linear(cfgs, needs_norm_output: bool) -> bool:
    """Whether a LayerNorm* layer whose FP8 preamble gave `cfgs` runs norm_linear: blockwise FP8
    on, the switch on, and no caller asking for the high-precision norm output."""
    on = FUSED.on and cfgs is not None and not needs_norm_output
    return on and blockwise_recipe() is not None


def _norm_output(z, gamma, beta, mu, rsigma, spec: NormSpec) -> torch.Tensor:
    """y in z's dtype, as the norm kernels compute it from z, mu and rsigma (float32 operations
    rounded one at a time): what the numerics report compares the tiles with."""
    g = gamma.float() + 1 if spec.zero_centered_gamma else gamma.float()
    d = z.float() if mu is None else z.float() - mu[:, None]
    y = (d * rsigma[:, None]) * g
    return (y if beta is None else y + beta.float()).to(z.dtype)


class _BlockwiseNormLinear(torch.autograd.Function):
    """(x, residual) -> (out, h = x + residual or None) with the module docstring's GEMMs."""

    @staticmethod
    def forward(fn_ctx, x, residual, gamma, beta, weight, bias, spec: NormSpec,
                power_2_scale: bool, block: BlockWeight | None):  # fmt: skip
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        res2 = None if residual is None else residual.reshape(-1, k).contiguous()
        needs_wgrad = fn_ctx.needs_input_grad[4]
        needs_dgrad = any(fn_ctx.needs_input_grad[:4])
        o = ops.blockwise_norm(x2, gamma, beta, spec.eps, transpose=needs_wgrad, residual=res2,
                               zero_centered_gamma=spec.zero_centered_gamma,
                               power_2_scale=power_2_scale)  # fmt: skip
        z = x2 if residual is None else o.residual_out
        w_blocks = _weight_blocks(weight, block, power_2_scale, needs_dgrad)
        observe_block(weight, "input", lambda: (_norm_output(z, gamma, beta, o.mu, o.rsigma, spec),
                                                o.out, o.scale_inv, 1))  # fmt: skip
        observe_block(weight, "weight", lambda: (weight.detach(), *w_blocks[:2], 128))
        out = blockwise_gemm(o.out, o.scale_inv, *w_blocks[:2], x.dtype)
        if bias is not None:
            out = out + bias
        saved = (z, gamma, o.mu, o.rsigma) + ((o.out_t, o.scale_inv_t) if needs_wgrad else ())
        fn_ctx.save_for_backward(*saved)
        fn_ctx.w_blocks = w_blocks if needs_dgrad else None  # as _BlockwiseLinear keeps them
        fn_ctx.spec, fn_ctx.p2, fn_ctx.weight, fn_ctx.shape = spec, power_2_scale, weight, x.shape
        fn_ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        fn_ctx.has_residual = residual is not None
        h = z.view(x.shape) if residual is not None else None
        return out.reshape(*x.shape[:-1], weight.shape[0]), h

    @staticmethod
    def backward(fn_ctx, dy, dh):
        z, gamma, mu, rsigma, *y_t = fn_ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = fn_ctx.dtypes
        needs = fn_ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dres = dgamma = dbeta = dw = db = None
        needs_dgrad = any(needs[:4])
        dy_q = quantize(dy2, 1, _E4M3, fn_ctx.p2, transpose=needs[4])
        if needs_dgrad:
            observe_block(fn_ctx.weight, "grad_output", lambda: (dy2, *dy_q[:2], 1))
            dy_norm = blockwise_gemm(*dy_q[:2], *_transposed(fn_ctx.w_blocks), x_dtype)
            dz = None if dh is None else dh.reshape(z.shape).contiguous()
            spec: NormSpec = fn_ctx.spec
            kw = dict(zero_centered_gamma=spec.zero_centered_gamma, dresidual=dz)
            if mu is not None:
                dx, dgamma, dbeta = ops.layernorm_bwd(dy_norm, z, mu, rsigma, gamma, **kw)
            else:
                dx, dgamma = ops.rmsnorm_bwd(dy_norm, z, rsigma, gamma, **kw)
            dx = dx.view(fn_ctx.shape)
            dres = dx if fn_ctx.has_residual else None
        if needs[4]:
            dw = blockwise_gemm(*dy_q[2:], *y_t, w_dtype)
        if needs[5]:
            db = dy2.sum(0).to(b_dtype)
        return dx, dres, dgamma, dbeta, dw, db, None, None, None


def norm_linear(module, x: torch.Tensor, residual: torch.Tensor | None, spec: NormSpec,
                weight: torch.Tensor, bias: torch.Tensor | None, cfgs: list,
                gemm: int = 0) -> tuple:  # fmt: skip
    """The module's norm of x (or of h = x + residual), then its linear GEMM `gemm`, blockwise.

    Args:
        module: owns layer_norm_weight (and layer_norm_bias for LayerNorm).
        x: (..., K) high precision; residual: like x, or None.
        spec: the norm; weight: (N, K); bias: (N,) or None.
        cfgs, gemm: the layer's BlockWeights (None entries: quantized in this call) and this
            weight's index among them.

    Returns:
        (out (..., N) in x's dtype, h (..., K) or None without a residual), differentiable.
    """
    recipe = blockwise_recipe()
    return _BlockwiseNormLinear.apply(x, residual, module.layer_norm_weight,
                                      module.layer_norm_bias, weight, bias, spec,
                                      recipe.power_2_scale, cfgs[gemm])  # fmt: skip
