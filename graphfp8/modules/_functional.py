"""The stateless FP8 linear: y = x @ w.T (+ b) with its three GEMMs in FP8.

    forward  y  (M, N) = x  (M, K) @ w.T   x_fp8 (E4M3)  x  w_fp8 (E4M3)
    dgrad    dx (M, K) = dy (M, N) @ w     dy_fp8 (E5M2 in HYBRID)  x  w_t_fp8
    wgrad    dw (N, K) = dy.T @ x          dy_t_fp8  x  x_t_fp8
             or, with fuse_wgrad_accumulation, main_grad (N, K) fp32 += dy.T @ x in the GEMM
             or, under GRAPHFP8_WGRAD_INTO_GRAD, w.grad = dy.T @ x (+ w.grad) in the GEMM

x and dy go through cast-transpose, so each is read once for both layouts; the weight is cast
into a persistent workspace (a Float8Tensor with its own scale_inv) only when the module says so.
All scales and amaxes are device views into the arenas, fetched when they are used.
"""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.fp8 import into_grad
from graphfp8.fp8 import main_grad as fused
from graphfp8.fp8.current import AmaxPass, amax_of, slot_quantizer
from graphfp8.fp8.observe import StatsSource, observe_cast
from graphfp8.fp8.scale_schedule import SCHEDULE
from graphfp8.fp8.scaling import SlotBlock
from graphfp8.fp8.slots import BwdRole, FwdRole, Quantizer, slot_index
from graphfp8.fp8.tensor import Float8Tensor

__all__ = [
    "GemmConfig",
    "cast_grad_output",
    "cast_input",
    "cast_weight_",
    "dgrad_gemm",
    "fp8_linear",
    "forward_gemm",
    "save_weight",
    "weight_t",
    "wgrad_gemm",
]


class GemmConfig:
    """Everything one FP8 GEMM call needs besides its tensors.

    Attributes:
        fwd, bwd: the module's slot blocks in the forward and backward arenas.
        gemm: which GEMM of the module this is (0 for fc1, 1 for fc2, ...).
        weight_fp8: the persistent FP8 weight workspace (data, transpose, private scale_inv).
        cast_weight: cast the weight into the workspace in this call (always True in a graph,
            where `weight_cache_flag` decides on the device).
        weight_cache_flag: (1,) float32 device flag, 1 = the cached FP8 weight is valid and the
            cast does nothing; None = cast unconditionally.
        fp8_output: return this GEMM's output as a Float8Tensor (its OUTPUT slot).
        backward_update: (backward arena, group) whose update runs at the end of the backward
            pass (eager mode), or None (graphs place it themselves).
        main_grad: (weight, its main_grad (N, K) float32) under fuse_wgrad_accumulation: the
            wgrad GEMM adds into main_grad and the weight gets no gradient; None otherwise.
        weight: the GEMM's weight parameter, whose .grad the wgrad GEMM may write itself
            (graphfp8/fp8/into_grad.py); None: dW always goes to autograd.
    """

    __slots__ = (
        "fwd", "bwd", "gemm", "weight_fp8", "cast_weight", "weight_cache_flag", "fp8_output",
        "backward_update", "main_grad", "weight",
    )  # fmt: skip

    def __init__(
        self,
        fwd: SlotBlock,
        bwd: SlotBlock,
        gemm: int,
        weight_fp8: Float8Tensor,
        cast_weight: bool,
        weight_cache_flag: torch.Tensor | None,
        fp8_output: bool = False,
        backward_update: tuple | None = None,
    ):
        self.fwd, self.bwd, self.gemm = fwd, bwd, gemm
        self.weight_fp8 = weight_fp8
        self.cast_weight = cast_weight
        self.weight_cache_flag = weight_cache_flag
        self.fp8_output = fp8_output
        self.backward_update = backward_update
        self.main_grad: tuple[torch.Tensor, torch.Tensor] | None = None
        self.weight: torch.Tensor | None = None

    def quantizer(self, role: FwdRole | BwdRole, amax_pass: AmaxPass | None = None,
                  three_launch: bool = False) -> Quantizer:  # fmt: skip
        """Scale, amax and FP8 dtype of this GEMM's slot for `role`; under current scaling the
        scale is first computed from `amax_pass` (graphfp8.fp8.current.slot_quantizer;
        three_launch for a cast that takes no scaled_max)."""
        block = self.fwd if isinstance(role, FwdRole) else self.bwd
        return slot_quantizer(block, slot_index(role, self.gemm), amax_pass, three_launch)

    def observe(self, role: FwdRole | BwdRole, source) -> None:
        """Reports a cast into this GEMM's slot for `role` to the numerics observer: `source` is
        a StatsSource, a function returning one, or the tensor that was cast
        (graphfp8.fp8.observe)."""
        if isinstance(source, torch.Tensor):
            source = StatsSource("identity", source)
        block = self.fwd if isinstance(role, FwdRole) else self.bwd
        observe_cast(block, slot_index(role, self.gemm), role.name.lower(), source)


def cast_input(inp, in_features: int, cfg: GemmConfig, needs_t: bool):
    """(x_fp8 (M, K), x_t_fp8 (K, M) or None, scale_inv) for a high-precision or FP8 input."""
    if isinstance(inp, Float8Tensor):
        x_fp8 = inp._data.reshape(-1, in_features)
        return x_fp8, (inp.transpose_fp8() if needs_t else None), inp._scale_inv
    x = inp.reshape(-1, in_features)
    if not x.is_contiguous():
        x = x.contiguous()
    quantizer = cfg.quantizer(FwdRole.INPUT, amax_of(x))
    if needs_t:
        out = ops.cast_transpose(x, *quantizer)
    else:
        x_fp8, scale_inv = ops.cast_to_fp8(x, *quantizer)
        out = x_fp8, None, scale_inv
    cfg.observe(FwdRole.INPUT, x)
    return out


def cast_weight_(weight: torch.Tensor, cfg: GemmConfig) -> Float8Tensor:
    """The GEMM's FP8 weight workspace, cast (both layouts) first when cfg says so.

    weight: (N, K) high precision, or an FP8 primary weight (a Float8Tensor parameter, its own
    workspace: only its transpose cache is rebuilt). The weight-cache flag lets a graph skip the
    cast on later microbatches.
    """
    w = cfg.weight_fp8
    if not cfg.cast_weight:
        return w
    flag = cfg.weight_cache_flag
    if w is weight:  # an FP8 primary weight: only its transpose cache is rebuilt (if it has one)
        if w._transpose is not None:
            w.rebuild_transpose_(flag)
        return w
    quantizer = cfg.quantizer(FwdRole.WEIGHT, amax_of(weight, flag))
    if w._transpose is None:  # transposes are not cached (FP8Module.cache_weight_transpose)
        ops.cast_to_fp8(weight, *quantizer, out=w._data, scale_inv=w._scale_inv, noop=flag)
    else:
        ops.cast_transpose(weight, *quantizer, out=w._data, out_t=w._transpose,
                           scale_inv=w._scale_inv, noop=flag)  # fmt: skip
    w.mark_data_changed(transpose_written=w._transpose is not None)
    cfg.observe(FwdRole.WEIGHT, StatsSource("identity", weight, skip=flag))
    return w


def forward_gemm(x_fp8, x_scale_inv, weight, bias, cfg: GemmConfig) -> torch.Tensor:
    """y (M, N) = x @ weight.T (+ bias) in weight.dtype, the bias fused into the GEMM when the
    output is bf16/fp16. x_fp8: (M, K) FP8; weight: (N, K); bias: (N,) or None."""
    w = cast_weight_(weight, cfg)
    out_dtype = weight.dtype
    fuse_bias = bias is not None and out_dtype != torch.float32
    y = ops.fp8_gemm(
        x_fp8, x_scale_inv, w._data.t(), w._scale_inv, out_dtype,
        bias=bias if fuse_bias else None, use_fast_accum=True,
    )  # fmt: skip
    return y + bias if bias is not None and not fuse_bias else y


def cast_grad_output(dy: torch.Tensor, cfg: GemmConfig, needs_wgrad: bool, needs_dbias: bool):
    """Casts the GEMM's grad output into its backward slot.

    dy: (M, N) contiguous. Returns (dy_fp8 (M, N), dy_t_fp8 (N, M) or None, scale_inv,
    dbias (N,) or None): one fused pass when both the transpose and the bias grad are needed.
    """
    quantizer = cfg.quantizer(BwdRole.GRAD_OUTPUT, amax_of(dy))
    if needs_wgrad and needs_dbias:
        out = ops.cast_transpose_dbias(dy, *quantizer)
    else:
        dbias = dy.sum(dim=0) if needs_dbias else None
        if needs_wgrad:
            out = (*ops.cast_transpose(dy, *quantizer), dbias)
        else:
            dy_fp8, scale_inv = ops.cast_to_fp8(dy, *quantizer)
            out = dy_fp8, None, scale_inv, dbias
    cfg.observe(BwdRole.GRAD_OUTPUT, dy)
    return out


def dgrad_gemm(dy_fp8, dy_scale_inv, w_t_fp8, w_scale_inv, out_dtype) -> torch.Tensor:
    """dx (M, K) = dy (M, N) @ w, from dy_fp8 (M, N) and the weight's transpose w_t_fp8 (K, N)."""
    return ops.fp8_gemm(dy_fp8, dy_scale_inv, w_t_fp8.t(), w_scale_inv, out_dtype)


def wgrad_gemm(dy_t_fp8, dy_scale_inv, x_t_fp8, x_scale_inv, out_dtype,
               cfg: GemmConfig | None = None) -> torch.Tensor | None:  # fmt: skip
    """dw (N, K) = dy.T @ x, from the transposes dy_t_fp8 (N, M) and x_t_fp8 (K, M); under
    cfg.main_grad the GEMM adds dw into the fp32 main_grad instead (cuBLASLt, beta = 1), under
    GRAPHFP8_WGRAD_INTO_GRAD into the weight's .grad where it can (fp8/into_grad.py), and
    returns None, the weight's gradient for autograd (docs/fp8.md, "Weight-gradient
    accumulation")."""
    if cfg is None:
        return ops.fp8_gemm(dy_t_fp8, dy_scale_inv, x_t_fp8.t(), x_scale_inv, out_dtype)
    if cfg.main_grad is None:
        if into_grad.write_wgrad(cfg.weight, dy_t_fp8, dy_scale_inv, x_t_fp8, x_scale_inv,
                                 out_dtype):  # fmt: skip
            return None
        return ops.fp8_gemm(dy_t_fp8, dy_scale_inv, x_t_fp8.t(), x_scale_inv, out_dtype)
    weight, main_grad = cfg.main_grad
    ops.fp8_gemm_accumulate_(dy_t_fp8, dy_scale_inv, x_t_fp8.t(), x_scale_inv, main_grad)
    fused.added(weight)
    return None


def save_weight(ctx, key: str, cfg: GemmConfig) -> None:
    """Keeps the weight workspace (a Float8Tensor) on ctx for weight_t(): the object, not its
    buffers, whose validity it carries. The workspace is rewritten in place by later casts: keep
    it out of save_for_backward's version checks. Under FSDP2 it is the gathered weight, whose
    buffers the reshard after forward frees and the backward's all-gather refills, leaving its
    transpose stale (docs/sharding.md, "FSDP2")."""
    setattr(ctx, key, cfg.weight_fp8)


def weight_t(w: Float8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_t_fp8 (K, N), scale_inv) of save_weight's workspace: its transpose cache, rebuilt
    first when its data changed since (an FSDP2 re-gather), or else a transpose of the FP8
    weight made now (the caller drops it after its GEMM)."""
    if w._transpose is None:
        return ops.fp8_transpose(w._data), w._scale_inv
    return w.transpose_fp8(), w._scale_inv


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, cfg: GemmConfig, needs_dgrad: bool, needs_wgrad: bool):
        out_features, in_features = weight.shape
        lead = inp.shape[:-1]
        x_fp8, x_t_fp8, x_scale_inv = cast_input(inp, in_features, cfg, needs_wgrad)
        y = forward_gemm(x_fp8, x_scale_inv, weight, bias, cfg)
        save_weight(ctx, "w", cfg)
        ctx.save_for_backward(x_t_fp8, x_scale_inv)
        ctx.cfg, ctx.inp_shape = cfg, inp.shape
        ctx.needs_dgrad, ctx.needs_wgrad = needs_dgrad, needs_wgrad
        ctx.has_bias = bias is not None
        if not cfg.fp8_output:
            return y.view(*lead, out_features)
        quantizer = cfg.quantizer(FwdRole.OUTPUT, amax_of(y))
        y_fp8, y_t_fp8, y_scale_inv = ops.cast_transpose(y, *quantizer)
        cfg.observe(FwdRole.OUTPUT, y)
        return Float8Tensor(
            y_fp8.view(*lead, out_features), y_scale_inv, y.dtype,
            transpose=y_t_fp8, transpose_valid=True,
        )  # fmt: skip

    @staticmethod
    def backward(ctx, dy):
        cfg: GemmConfig = ctx.cfg
        x_t_fp8, x_scale_inv = ctx.saved_tensors
        needs_dbias = ctx.has_bias and ctx.needs_input_grad[2]
        dy_fp8, dy_t_fp8, dy_scale_inv, dbias = cast_grad_output(
            dy.reshape(-1, dy.shape[-1]).contiguous(), cfg, ctx.needs_wgrad, needs_dbias
        )
        dx = dw = None
        if ctx.needs_dgrad:
            dx = dgrad_gemm(dy_fp8, dy_scale_inv, *weight_t(ctx.w), dy.dtype).view(ctx.inp_shape)
        dy_fp8 = None  # freed before the wgrad output is allocated
        if ctx.needs_wgrad:
            dw = wgrad_gemm(dy_t_fp8, dy_scale_inv, x_t_fp8, x_scale_inv, dy.dtype, cfg)
        SCHEDULE.after_backward(cfg.backward_update)
        return dx, dw, dbias, None, None, None


def fp8_linear(inp, weight, bias, cfg: GemmConfig):
    """FP8 linear layer: y = inp @ weight.T + bias.

    Args:
        inp: (..., K) in weight.dtype, or a Float8Tensor of that nominal dtype (used as is).
        weight: (N, K); K and N multiples of 16.
        bias: (N,) or None.
        cfg: slots, weight workspace and cast decision of this GEMM.

    Returns:
        (..., N) tensor of weight.dtype, or a Float8Tensor when cfg.fp8_output.
    """
    grad = torch.is_grad_enabled()
    needs_dgrad = grad and inp.requires_grad
    needs_wgrad = grad and weight.requires_grad
    return _FP8Linear.apply(inp, weight, bias, cfg, needs_dgrad, needs_wgrad)
