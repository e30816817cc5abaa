"""LayerNormMLP's activation and fc2 under Float8BlockScaling, the activation writing fc2's
blockwise FP8 input itself (graphfp8.ops.blockwise_act: a's 1x128 tiles along K and a.T's along
the tokens from one op, no high-precision a written on CUDA), as the per-tensor path's fused
activation writes fc2's FP8 input (modules/_mlp.py). LayerNormMLP runs it for "gelu", "swiglu"
and "geglu" under the switch GRAPHFP8_BLOCKWISE_ACT (off by default until its CUDA kernel has
run on a GPU; docs/fp8.md, "Blockwise scaling"); off, torch's activation runs and fc2 quantizes
its output (modules/_blockwise.py).

    forward   a_q = blockwise_act(h);  out = a_q @ w.T (+ b)
    backward  da = dy @ w (blockwise dgrad), dw = dy.T @ a.T's tiles, dh = act'(h) da by the ops
              autograd runs for torch's activation (gelu_backward, silu_backward, the products)

Saved for the backward: h, fc1's high-precision output (the activation's backward reads it), and
a.T's tiles (fc2's wgrad operand); never a itself. The switch changes the forward by the
activation's rounding (the kernels' tanh / exp against torch's: the last bits of a), fc2's dw
with it; dh, and so every gradient before fc2, is the switch-off path's bit for bit (the same
dgrad GEMM and activation backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphfp8 import ops
from graphfp8.fp8.observe import observe_block
from graphfp8.fp8.weight_cache import BlockWeight
from graphfp8.modules._blockwise import _transposed, _weight_blocks
from graphfp8.modules._context import blockwise_recipe
from graphfp8.ops.blockwise import blockwise_gemm, quantize
from graphfp8.ops.blockwise_act import BLOCK_ACTIVATIONS
from graphfp8.ops.glu import glu
from graphfp8.ops.switches import env_switch

__all__ = ["FUSED", "act_linear", "fused_act_linear"]

_E4M3 = torch.float8_e4m3fn


class _Switch:
    """GRAPHFP8_BLOCKWISE_ACT, read at import; `FUSED.on` may be changed at run time."""

    def __init__(self) -> None:
        self.on = env_switch("BLOCKWISE_ACT")


FUSED = _Switch()


def fused_act_linear(cfgs, activation: str) -> bool:
    """Whether LayerNormMLP, its FP8 preamble having given `cfgs`, runs act_linear: blockwise FP8
    on, the switch on and an activation the kernel has."""
    on = FUSED.on and cfgs is not None and activation in BLOCK_ACTIVATIONS
    return on and blockwise_recipe() is not None


def _act_values(h: torch.Tensor, activation: str) -> torch.Tensor:
    """a in h's dtype by torch ops (what the numerics report compares the tiles with): the
    kernel's values on the CPU (GELU as GeGLU's gate with u = 1, csrc/blockwise_act.h), within
    the transcendentals' last bits on CUDA."""
    cpu = h.device.type == "cpu"
    if activation == "gelu" and not cpu:
        return F.gelu(h, approximate="tanh")
    if activation == "gelu":
        h, activation = torch.cat([h, torch.ones_like(h)], dim=-1), "geglu"
    return glu(h, activation, precise=cpu)


def _act_backward(da: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """dh (rows, width of h) for da (rows, F): the ops autograd runs through layernorm_mlp's
    ACTIVATIONS (F.gelu; act(g) * u with g, u = h.chunk(2)), in the same order."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(da, h, approximate="tanh")
    g, u = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return torch.cat([torch.ops.aten.silu_backward(da * u, g), da * F.silu(g)], dim=-1)
    gelu_g = F.gelu(g, approximate="tanh")
    dg = torch.ops.aten.gelu_backward(da * u, g, approximate="tanh")
    return torch.cat([dg, da * gelu_g], dim=-1)


class _BlockwiseActLinear(torch.autograd.Function):
    """out = act(h) @ w.T + b with the module docstring's GEMMs."""

    @staticmethod
    def forward(fn_ctx, h, weight, bias, activation: str, power_2_scale: bool,
                block: BlockWeight | None):  # fmt: skip
        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        needs_dgrad, needs_wgrad = fn_ctx.needs_input_grad[:2]
        a = ops.blockwise_act(h2, activation, transpose=needs_wgrad, power_2_scale=power_2_scale)
        w_blocks = _weight_blocks(weight, block, power_2_scale, needs_dgrad)
        observe_block(weight, "input", lambda: (_act_values(h2, activation), a.out, a.scale_inv, 1))
        observe_block(weight, "weight", lambda: (weight.detach(), *w_blocks[:2], 128))
        out = blockwise_gemm(a.out, a.scale_inv, *w_blocks[:2], h.dtype)
        if bias is not None:
            out = out + bias
        fn_ctx.save_for_backward(h2 if needs_dgrad else None, a.out_t, a.scale_inv_t)
        fn_ctx.w_blocks = w_blocks if needs_dgrad else None  # as _BlockwiseLinear keeps them
        fn_ctx.activation, fn_ctx.p2, fn_ctx.weight = activation, power_2_scale, weight
        fn_ctx.h_shape = h.shape
        fn_ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return out.reshape(*h.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(fn_ctx, dy):
        h2, a_t, a_t_scale_inv = fn_ctx.saved_tensors
        w_dtype, b_dtype = fn_ctx.dtypes
        needs_dgrad, needs_wgrad, needs_dbias = fn_ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = dw = db = None
        if needs_dgrad or needs_wgrad:
            dy_q = quantize(dy2, 1, _E4M3, fn_ctx.p2, transpose=needs_wgrad)
        if needs_dgrad:
            observe_block(fn_ctx.weight, "grad_output", lambda: (dy2, *dy_q[:2], 1))
            da = blockwise_gemm(*dy_q[:2], *_transposed(fn_ctx.w_blocks), h2.dtype)
            dh = _act_backward(da, h2, fn_ctx.activation).view(fn_ctx.h_shape)
        if needs_wgrad:
            dw = blockwise_gemm(*dy_q[2:], a_t, a_t_scale_inv, w_dtype)
        if needs_dbias:
            db = dy2.sum(0).to(b_dtype)
        return dh, dw, db, None, None, None


def act_linear(h: torch.Tensor, activation: str, weight: torch.Tensor, bias: torch.Tensor | None,
               cfgs: list, gemm: int = 1) -> torch.Tensor:  # fmt: skip
    """fc2(act(h)) with blockwise FP8, the activation quantizing fc2's input (module docstring).

    Args:
        h: (..., F) for "gelu", (..., 2 F) for "swiglu" / "geglu": fc1's output, high precision.
        activation: one of graphfp8.ops.blockwise_act.BLOCK_ACTIVATIONS.
        weight: (N, F); bias: (N,) or None.
        cfgs, gemm: the layer's BlockWeights (None entries: quantized in this call) and this
            weight's index among them.

    Returns:
        (..., N) in h's dtype, differentiable in h, weight and bias.
    """
    recipe = blockwise_recipe()
    return _BlockwiseActLinear.apply(h, weight, bias, activation, recipe.power_2_scale,
                                     cfgs[gemm])  # fmt: skip
