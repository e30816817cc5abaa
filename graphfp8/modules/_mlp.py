"""The stateless FP8 MLP: y = fc2(act(fc1(x))) with the activation fused into the FP8 casts around
it, for act = GELU (tanh) and the gated SwiGLU / GeGLU (graphfp8.ops.glu).

    forward   h = fc1(x)                          FP8 GEMM, bias fused; (T, F), or (T, 2F) = [g | u]
              a_fp8, a_t_fp8 = act_cast_transpose(h)      (act(h) is never written)
              y = fc2(a)                          FP8 GEMM, bias fused
    backward  dy_fp8, dy_t_fp8, db2 = cast_transpose_dbias(dy)
              da = dgrad2, dw2 = wgrad2
              dh_fp8, dh_t_fp8, db1 = dact_cast_transpose_dbias(da, h)
              dx = dgrad1, dw1 = wgrad1

The activations (`FusedActivation`): GELU runs gelu_cast_transpose / dgelu_cast_transpose_dbias;
SwiGLU and GeGLU run glu_cast_transpose / dglu_cast_transpose_dbias where those kernels are on
(graphfp8.ops.glu.fused_glu_kernels), else the same math in torch ops followed by the plain
cast-transposes, so that every device has a working path.

Slots: act(h) is fc2's INPUT, dh is fc1's GRAD_OUTPUT, dy is fc2's GRAD_OUTPUT.

recompute_act (selective recompute, TransformerLayer(recompute="selective")): a_t_fp8 is not
kept for fc2's wgrad but cast again from h in the backward, with the scales of fc2's forward
slots saved after the forward and amaxes into a scratch (ReplaySlots): the same bits,
T * F bytes less per layer, one more activation kernel in the backward.
"""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.fp8.current import amax_of, dgelu_amax_of, gelu_amax_of
from graphfp8.fp8.observe import StatsSource
from graphfp8.fp8.scale_schedule import SCHEDULE
from graphfp8.fp8.scaling import ReplaySlots
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
from graphfp8.ops.glu import GLU_ACTIVATIONS, dglu, fused_glu_kernels, glu

__all__ = ["FUSED_ACTIVATIONS", "FusedActivation", "fp8_mlp"]


class FusedActivation:
    """The activation's two fused steps for one call (`name`: "gelu", "swiglu" or "geglu").

    forward(h, cfg2) -> (a_fp8 (T, F), a_t_fp8 (F, T), scale_inv): act(h) cast into fc2's INPUT.
    backward(da, h, cfg1, needs_t, needs_db) -> (dh_fp8, dh_t_fp8 or None, scale_inv, db or
    None): the activation's backward cast into fc1's GRAD_OUTPUT (the transpose when needs_t).
    """

    def __init__(self, name: str, device):
        if name not in FUSED_ACTIVATIONS:
            raise ValueError(f"graphfp8: no fused FP8 MLP for activation {name!r}")
        self.name = name
        self.fused = name == "gelu" or fused_glu_kernels(device)

    def forward(self, h: torch.Tensor, cfg: GemmConfig):
        if self.name == "gelu":
            run = lambda q: ops.gelu_cast_transpose(h, *q)  # noqa: E731
            amax_pass = gelu_amax_of(h)
            source = StatsSource("gelu", h)
        elif self.fused:
            run = amax_pass = lambda q: ops.glu_cast_transpose(h, self.name, *q)  # noqa: E731
            # The report recomputes act(h) as the kernel does (float64 exp/tanh on the CPU).
            source = lambda: StatsSource("identity", glu(h, self.name, h.is_cpu))  # noqa: E731
        else:
            a = glu(h, self.name)
            out = ops.cast_transpose(a, *cfg.quantizer(FwdRole.INPUT, amax_of(a)))
            cfg.observe(FwdRole.INPUT, a)
            return out
        # The GLU kernels take no scaled_max: current scaling's three-launch sequence for them.
        out = run(cfg.quantizer(FwdRole.INPUT, amax_pass, three_launch=self.name != "gelu"))
        cfg.observe(FwdRole.INPUT, source)
        return out

    def backward(self, da, h, cfg: GemmConfig, needs_t: bool, needs_db: bool):
        name = self.name
        if name == "gelu":  # dbias comes free with the fused pass
            run = lambda q: ops.dgelu_cast_transpose_dbias(da, h, *q)  # noqa: E731
            amax_pass = dgelu_amax_of(da, h)
            source = StatsSource("dgelu", da, act_in=h)
        elif self.fused:  # the fused kernels always write the transpose
            run = amax_pass = lambda q: ops.dglu_cast_transpose_dbias(da, h, name, *q,  # noqa: E731
                                                                      dbias=needs_db)  # fmt: skip
            source = lambda: StatsSource("identity", dglu(da, h, name, h.is_cpu))  # noqa: E731
        else:  # cast_grad_output reports its cast itself
            return cast_grad_output(dglu(da, h, name), cfg, needs_t, needs_db)
        out = run(cfg.quantizer(BwdRole.GRAD_OUTPUT, amax_pass, three_launch=name != "gelu"))
        cfg.observe(BwdRole.GRAD_OUTPUT, source)
        return out


FUSED_ACTIVATIONS = ("gelu", *GLU_ACTIVATIONS)


class _FP8FusedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, w1, b1, w2, b2, cfg1: GemmConfig, cfg2: GemmConfig, needs: tuple,
                act: FusedActivation, recompute_act: bool):  # fmt: skip
        hidden = w1.shape[1]
        lead = inp.shape[:-1]
        x_fp8, x_t_fp8, x_scale_inv = cast_input(inp, hidden, cfg1, needs[1])
        h = forward_gemm(x_fp8, x_scale_inv, w1, b1, cfg1)
        a_fp8, a_t_fp8, a_scale_inv = act.forward(h, cfg2)
        y = forward_gemm(a_fp8, a_scale_inv, w2, b2, cfg2)
        save_weight(ctx, "w1", cfg1)
        save_weight(ctx, "w2", cfg2)
        ctx.act_replay = None
        if recompute_act and needs[2]:  # fc2's forward scales, as the act cast left them
            block = getattr(cfg2.fwd, "block", cfg2.fwd)  # under Replay/FrozenSlots
            ctx.act_replay = GemmConfig(ReplaySlots(block, cfg2.fwd.scales().clone()), cfg2.bwd,
                                        1, cfg2.weight_fp8, False, None)  # fmt: skip
            a_t_fp8 = None
        ctx.save_for_backward(x_t_fp8, x_scale_inv, h, a_t_fp8, a_scale_inv)
        ctx.cfgs, ctx.inp_shape, ctx.needs, ctx.act = (cfg1, cfg2), inp.shape, needs, act
        ctx.has_bias = (b1 is not None, b2 is not None)
        return y.view(*lead, w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        cfg1, cfg2 = ctx.cfgs
        needs_dgrad, needs_wgrad1, needs_wgrad2 = ctx.needs
        x_t_fp8, x_scale_inv, h, a_t_fp8, a_scale_inv = ctx.saved_tensors
        SCHEDULE.after_backward(cfg1.backward_update)
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
            dh_fp8, dh_t_fp8, dh_scale_inv, db1 = ctx.act.backward(
                da, h, cfg1, needs_wgrad1, needs_db1
            )
            da = None
        if ctx.act_replay is not None:  # selective recompute: act(h) cast again, same bits
            a_t_fp8 = ctx.act.forward(h, ctx.act_replay)[1]
        dw2 = (
            wgrad_gemm(dy_t_fp8, dy_scale_inv, a_t_fp8, a_scale_inv, dy.dtype, cfg2)
            if needs_wgrad2
            else None
        )
        dy_t_fp8 = None
        if not needs_fc1:
            return None, None, None, dw2, db2, None, None, None, None, None
        dx = dw1 = None
        if needs_dgrad:
            dx = dgrad_gemm(dh_fp8, dh_scale_inv, *weight_t(ctx.w1), dy.dtype).view(ctx.inp_shape)
        dh_fp8 = None
        if needs_wgrad1:
            dw1 = wgrad_gemm(dh_t_fp8, dh_scale_inv, x_t_fp8, x_scale_inv, dy.dtype, cfg1)
        return dx, dw1, db1 if needs_db1 else None, dw2, db2, None, None, None, None, None


def fp8_mlp(inp, w1, b1, w2, b2, cfg1: GemmConfig, cfg2: GemmConfig, activation: str = "gelu",
            recompute_act: bool = False):  # fmt: skip
    """FP8 MLP y = act(inp @ w1.T + b1) @ w2.T + b2 with the activation fused into the casts.

    Args:
        inp: (..., H) in w1.dtype (high precision), or a Float8Tensor of that nominal dtype in
            cfg1's INPUT slot (a norm's FP8 output, used as is).
        w1: (F1, H) with F1 = F ("gelu") or 2F, the gate rows first ("swiglu", "geglu");
            b1: (F1,) or None; w2: (H, F); b2: (H,) or None. H, F multiples of 16.
        cfg1, cfg2: slots, weight workspaces and cast decisions of fc1 (gemm 0) and fc2 (gemm 1).
        activation: "gelu" (tanh approximation), "swiglu" or "geglu".
        recompute_act: cast act(h) again in the backward instead of keeping its FP8 transpose
            (T * F bytes) for fc2's wgrad; the same bits.

    Returns:
        (..., H) tensor of w2.dtype.
    """
    grad = torch.is_grad_enabled()
    needs = (grad and inp.requires_grad, grad and w1.requires_grad, grad and w2.requires_grad)
    act = FusedActivation(activation, w1.device)
    return _FP8FusedMLP.apply(inp, w1, b1, w2, b2, cfg1, cfg2, needs, act, recompute_act)
