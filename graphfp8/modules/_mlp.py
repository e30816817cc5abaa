"""The stateless FP8 MLP: y = fc2(gelu(fc1(x))) with GELU fused into the FP8 casts around it.

    forward   h = fc1(x)                          FP8 GEMM, bias fused
              a_fp8, a_t_fp8 = gelu_cast_transpose(h)   (gelu(h) is never written)
              y = fc2(a)                          FP8 GEMM, bias fused
    backward  dy_fp8, dy_t_fp8, db2 = cast_transpose_dbias(dy)
              da = dgrad2, dw2 = wgrad2
              dh_fp8, dh_t_fp8, db1 = dgelu_cast_transpose_dbias(da, h)
              dx = dgrad1, dw1 = wgrad1

Slots: gelu(h) is fc2's INPUT, dh is fc1's GRAD_OUTPUT, dy is fc2's GRAD_OUTPUT.
"""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.fp8.autocast import queue_backward_update
from graphfp8.fp8.current import dgelu_amax_of, gelu_amax_of
from graphfp8.fp8.observe import StatsSource
from graphfp8.fp8.slots import BwdRole, FwdRole
from graphfp8.modules._functional import (
    GemmConfig,
    cast_grad_output,
    cast_input,
    dgrad_gemm,
    forward_gemm,
    save_weight,
    weight_t,
    wgrad_gemm,
)

__all__ = ["fp8_gelu_mlp"]


class _FP8GeluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, w1, b1, w2, b2, cfg1: GemmConfig, cfg2: GemmConfig, needs: tuple):
        hidden = w1.shape[1]
        lead = inp.shape[:-1]
        x_fp8, x_t_fp8, x_scale_inv = cast_input(inp, hidden, cfg1, needs[1])
        h = forward_gemm(x_fp8, x_scale_inv, w1, b1, cfg1)
        a_quantizer = cfg2.quantizer(FwdRole.INPUT, gelu_amax_of(h))
        a_fp8, a_t_fp8, a_scale_inv = ops.gelu_cast_transpose(h, *a_quantizer)
        cfg2.observe(FwdRole.INPUT, StatsSource("gelu", h))
        y = forward_gemm(a_fp8, a_scale_inv, w2, b2, cfg2)
        save_weight(ctx, "w1", cfg1)
        save_weight(ctx, "w2", cfg2)
        ctx.save_for_backward(x_t_fp8, x_scale_inv, h, a_t_fp8, a_scale_inv)
        ctx.cfgs, ctx.inp_shape, ctx.needs = (cfg1, cfg2), inp.shape, needs
        ctx.has_bias = (b1 is not None, b2 is not None)
        return y.view(*lead, w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        cfg1, cfg2 = ctx.cfgs
        needs_dgrad, needs_wgrad1, needs_wgrad2 = ctx.needs
        x_t_fp8, x_scale_inv, h, a_t_fp8, a_scale_inv = ctx.saved_tensors
        if cfg1.backward_update is not None:
            queue_backward_update(*cfg1.backward_update)
        needs_db1 = ctx.has_bias[0] and ctx.needs_input_grad[2]
        needs_db2 = ctx.has_bias[1] and ctx.needs_input_grad[4]
        needs_fc1 = needs_dgrad or needs_wgrad1 or needs_db1
        # Ordered so that each intermediate dies before the next big one is allocated (da
        # before the wgrad outputs, dy's FP8 forms before dh's): the backward's peak is da (T, F)
        # and dh's two FP8 layouts, not every intermediate at once.
        dy_fp8, dy_t_fp8, dy_scale_inv, db2 = cast_grad_output(
            dy.reshape(-1, dy.shape[-1]).contiguous(), cfg2, needs_wgrad2, needs_db2
        )
        da = dgrad_gemm(dy_fp8, dy_scale_inv, *weight_t(ctx.w2), dy.dtype) if needs_fc1 else None
        dy_fp8 = dh_fp8 = dh_t_fp8 = dh_scale_inv = db1 = None
        if needs_fc1:
            dh_q = cfg1.quantizer(BwdRole.GRAD_OUTPUT, dgelu_amax_of(da, h))
            dh_fp8, dh_t_fp8, dh_scale_inv, db1 = ops.dgelu_cast_transpose_dbias(da, h, *dh_q)
            cfg1.observe(BwdRole.GRAD_OUTPUT, StatsSource("dgelu", da, act_in=h))
            da = None
        dw2 = (
            wgrad_gemm(dy_t_fp8, dy_scale_inv, a_t_fp8, a_scale_inv, dy.dtype)
            if needs_wgrad2
            else None
        )
        dy_t_fp8 = None
        if not needs_fc1:
            return None, None, None, dw2, db2, None, None, None
        dx = dw1 = None
        if needs_dgrad:
            dx = dgrad_gemm(dh_fp8, dh_scale_inv, *weight_t(ctx.w1), dy.dtype).view(ctx.inp_shape)
        dh_fp8 = None
        if needs_wgrad1:
            dw1 = wgrad_gemm(dh_t_fp8, dh_scale_inv, x_t_fp8, x_scale_inv, dy.dtype)
        return dx, dw1, db1 if needs_db1 else None, dw2, db2, None, None, None


def fp8_gelu_mlp(inp, w1, b1, w2, b2, cfg1: GemmConfig, cfg2: GemmConfig) -> torch.Tensor:
    """FP8 MLP with the tanh GELU: y = gelu(inp @ w1.T + b1) @ w2.T + b2.

    Args:
        inp: (..., H) in w1.dtype (high precision), or a Float8Tensor of that nominal dtype in
            cfg1's INPUT slot (a norm's FP8 output, used as is).
        w1: (F, H); b1: (F,) or None; w2: (H, F); b2: (H,) or None. H, F multiples of 16.
        cfg1, cfg2: slots, weight workspaces and cast decisions of fc1 (gemm 0) and fc2 (gemm 1).

    Returns:
        (..., H) tensor of w2.dtype.
    """
    grad = torch.is_grad_enabled()
    needs = (grad and inp.requires_grad, grad and w1.requires_grad, grad and w2.requires_grad)
    return _FP8GeluMLP.apply(inp, w1, b1, w2, b2, cfg1, cfg2, needs)
