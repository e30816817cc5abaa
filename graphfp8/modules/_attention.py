"""The stateless FP8 attention: autograd Functions over the FP8 casts, cuDNN's FP8 attention
(graphfp8.ops.sdpa_fp8, emulated on the CPU) and the gradient casts. Every scale, descale and
amax is a device view into the arenas (the attention's AttnFwdRole / AttnBwdRole slots).

    fused QKV (FP8 MHA chain, TransformerLayer):
      forward   qkv (B, S, (H + 2G) D) --rope_fp8--> Q, K, V (FP8, BSHD) --sdpa_fp8_fwd--> O (FP8)
                O -> Float8Tensor (fp8_output: the next Linear consumes it as is) or dequantized
      backward  dO --cast--> dO (FP8) --sdpa_fp8_bwd--> dQ, dK, dV (FP8)
                --rope_fp8_backward--> dqkv (dequantize + inverse rotation, one pass)
    separate q, k, v (DotProductAttention.forward): the same with three casts in, three
      dequantizes out.

Every descale that pairs with a scale is its reciprocal computed next to it: O's scale_inv and
S's descale from one reciprocal of the adjacent S, O scales (written 16 bytes apart: O's
scale_inv may become a GEMM's scale, which cuBLASLt wants 16-byte aligned); the backward's four
from one reciprocal of the adjacent dP, dQ, dK, dV scales. S's (scale, descale) pair is kept for the
backward, so it quantizes P with the forward's pair even if the forward arena moved on since.
"""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.fp8.observe import StatsSource, observe_cast
from graphfp8.fp8.recipe import fp8_max
from graphfp8.fp8.scale_schedule import SCHEDULE
from graphfp8.fp8.scaling import SlotBlock
from graphfp8.fp8.slots import AttnBwdRole, AttnFwdRole, Quantizer, slot_index, slot_range
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.ops import cudnn_ragged, cudnn_sdpa

__all__ = [
    "AttentionConfig",
    "backward_dtype",
    "fp8_attention",
    "fp8_attention_qkv",
    "prepare_attention",
]

_E4M3 = torch.float8_e4m3fn


def backward_dtype(recipe) -> torch.dtype:
    """The FP8 dtype of the attention's backward under `recipe`: E4M3 with fp8_dpa_e4m3_bwd,
    else the format's backward dtype (notes/FP8_ATTENTION.md)."""
    return _E4M3 if recipe.fp8_dpa_e4m3_bwd else recipe.fp8_format.bwd_dtype


class AttentionConfig:
    """Everything one FP8 attention call needs besides its tensors.

    Attributes:
        fwd, bwd: the module's slot blocks (AttnFwdRole / AttnBwdRole slots of attention 0).
        attn_scale: the softmax scale.
        causal: the causal mask (FP8 attention supports only it).
        fp8_output: return O as a Float8Tensor (FP8 MHA) instead of dequantizing it.
        backward_update: (backward arena, group) updated at the end of the backward pass
            (eager), or None (graphs place it themselves).
        segment_ids: (batch, seq) integer segments of this call (graphfp8.ops.segments), or None.
        e4m3_bwd: the backward runs in E4M3 whatever the backward arena's format (the recipe's
            fp8_dpa_e4m3_bwd).
    """

    __slots__ = (
        "fwd", "bwd", "attn_scale", "causal", "fp8_output", "backward_update", "segment_ids",
        "e4m3_bwd",
    )  # fmt: skip

    def __init__(
        self,
        fwd: SlotBlock,
        bwd: SlotBlock,
        attn_scale: float,
        causal: bool,
        fp8_output: bool,
        backward_update: tuple | None,
        segment_ids: torch.Tensor | None = None,
        e4m3_bwd: bool = False,
    ):
        self.fwd, self.bwd = fwd, bwd
        self.attn_scale, self.causal = attn_scale, causal
        self.fp8_output, self.backward_update = fp8_output, backward_update
        self.segment_ids, self.e4m3_bwd = segment_ids, e4m3_bwd

    def backward_format(self) -> tuple[torch.dtype, float | None]:
        """(dtype, factor) of the backward's FP8 tensors: the arena's format (factor None), or
        E4M3 at each slot's scale times factor = E4M3's max over the arena format's (1/128 for
        E5M2: a power of two, so scales, descales and amaxes stay exact)."""
        arena_dtype = self.bwd.arena.fp8_dtype
        if not self.e4m3_bwd or arena_dtype == _E4M3:
            return arena_dtype, None
        return _E4M3, fp8_max(_E4M3) / fp8_max(arena_dtype)

    def quantizer(self, role: AttnFwdRole | AttnBwdRole) -> Quantizer:
        block = self.fwd if isinstance(role, AttnFwdRole) else self.bwd
        i = slot_index(role, 0)
        return Quantizer(block.scale(i), block.amax(i), block.arena.fp8_dtype)

    def amax(self, role: AttnFwdRole | AttnBwdRole) -> torch.Tensor:
        return self.quantizer(role).amax

    def observe(self, role: AttnFwdRole | AttnBwdRole, x: torch.Tensor, mode: str) -> None:
        """Reports the cast into `role`'s slot to the numerics observer (graphfp8.numerics):
        mode "identity" with the high-precision x that was cast, or "recorded" with the FP8
        result of a cast whose input never exists."""
        block = self.fwd if isinstance(role, AttnFwdRole) else self.bwd
        observe_cast(block, slot_index(role, 0), role.name.lower(), StatsSource(mode, x))

    def scales(self, first, last) -> torch.Tensor:
        """The consecutive scales of roles first..last, one (n,) view of the arena."""
        block = self.fwd if isinstance(first, AttnFwdRole) else self.bwd
        return block.scales()[slot_range(first, last, 0)]


def prepare_attention(
    q_shape, kv_shape, device, recipe, attn_scale: float, causal: bool, training: bool,
    segments: bool = False, deterministic: bool | None = None,
) -> None:  # fmt: skip
    """Checks an FP8 attention call and, on the GPU, builds its cuDNN graphs (cached): raises
    before any kernel or state change of the call, and keeps graph building out of CUDA-graph
    captures (a capture's warmup runs the same call first).

    Args:
        q_shape: (batch, seq, heads, head_dim); kv_shape: (batch, seq, kv_heads, head_dim).
        device: where the call runs.
        recipe: the DelayedScaling in force (its formats are the attention's FP8 dtypes).
        attn_scale, causal: the softmax scale and mask.
        training: the backward will run too (its graph is built now as well).
        segments: the call has segment_ids.
        deterministic: build the deterministic backward; None: whether torch's deterministic
            algorithms are on (what the backward call will ask for).
    """
    ops.check_sdpa_fp8(q_shape, kv_shape, kv_shape, causal, "graphfp8 FP8 attention")
    device = torch.device(device)
    if device.type != "cuda":
        return
    if segments:
        cudnn_ragged.check_enabled("graphfp8 FP8 attention")
    b, s, h, d = q_shape
    fmt = recipe.fp8_format
    key = cudnn_sdpa.SdpaKey(
        device.index,
        b,
        s,
        h,
        kv_shape[2],
        d,
        fmt.fwd_dtype,
        backward_dtype(recipe),
        float(attn_scale),
        bool(causal),
        bool(segments),
        torch.are_deterministic_algorithms_enabled() if deterministic is None else deterministic,
    )
    cudnn_sdpa.prepare(key, backward=training)


def _spaced_reciprocal(scales: torch.Tensor) -> torch.Tensor:
    """1 / scales ((n,) float32) as an (n,) view whose elements lie 16 bytes apart, so that each
    is 16-byte aligned: O's scale_inv goes with O into the projection's FP8 GEMM under fp8_mha,
    and cuBLASLt rejects a scale pointer that is not (graphfp8.ops.gemm.check_aligned)."""
    out = torch.empty(scales.shape[0], 4, dtype=torch.float32, device=scales.device)[:, 0]
    return torch.reciprocal(scales, out=out)


def _forward_core(ctx, qkv_fp8, qkv_scale_inv, cfg: AttentionConfig, needs_grad: bool):
    """Runs the FP8 attention on Q, K, V (FP8) and saves what the backward needs on ctx;
    returns (O (FP8, BSHD), O's scale_inv)."""
    q, k, v = qkv_fp8
    s_o = cfg.scales(AttnFwdRole.S, AttnFwdRole.O)  # (scale_S, scale_O)
    inv = _spaced_reciprocal(s_o)  # (descale_S, O's scale_inv)
    scales = dict(zip(("descale_q", "descale_k", "descale_v"), qkv_scale_inv, strict=True))
    scales.update(descale_s=inv[0:1], scale_s=s_o[0:1], scale_o=s_o[1:2])
    o, stats = ops.sdpa_fp8_forward(
        q,
        k,
        v,
        scales,
        cfg.amax(AttnFwdRole.S),
        cfg.amax(AttnFwdRole.O),
        cfg.attn_scale,
        cfg.causal,
        cfg.segment_ids,
    )
    cfg.observe(AttnFwdRole.O, o, "recorded")
    if needs_grad:
        scale_s = s_o[0:1].clone()  # the pair P was quantized with, for the backward
        ctx.save_for_backward(q, k, v, o, stats, *qkv_scale_inv, inv, scale_s)
        ctx.cfg = cfg
    return o, inv[1:2]


def _backward_core(ctx, grad: torch.Tensor):
    """dO (B, S, H * D or H, D) -> ([dQ, dK, dV] FP8, their scale_invs)."""
    cfg: AttentionConfig = ctx.cfg
    q, k, v, o, stats, q_si, k_si, v_si, inv, scale_s = ctx.saved_tensors
    d_o = grad.reshape(o.shape)
    if not d_o.is_contiguous():
        d_o = d_o.contiguous()
    dtype, factor = cfg.backward_format()
    scale_do, amax_do, _ = cfg.quantizer(AttnBwdRole.DO)
    bwd = cfg.scales(AttnBwdRole.DP, AttnBwdRole.DV)  # (scale_dP, scale_dQ, scale_dK, scale_dV)
    if factor is not None:  # E4M3 at the slots' scales * factor (the amaxes are the slots')
        scale_do, bwd = scale_do * factor, bwd * factor
    do_fp8, do_si = ops.cast_to_fp8(d_o, scale_do, amax_do, dtype)
    # the numerics report's dO stats assume the arena's format: under E4M3 the amax only
    cfg.observe(AttnBwdRole.DO, do_fp8 if factor else d_o, "recorded" if factor else "identity")
    bwd_inv = torch.reciprocal(bwd)
    scales = dict(
        descale_q=q_si,
        descale_k=k_si,
        descale_v=v_si,
        descale_o=inv[1:2],
        descale_do=do_si,
        descale_s=inv[0:1],
        descale_dp=bwd_inv[0:1],
        scale_s=scale_s,
        scale_dp=bwd[0:1],
        scale_dq=bwd[1:2],
        scale_dk=bwd[2:3],
        scale_dv=bwd[3:4],
    )
    amaxes = [cfg.amax(r) for r in (AttnBwdRole.DP, AttnBwdRole.DQ, AttnBwdRole.DK, AttnBwdRole.DV)]
    grads = ops.sdpa_fp8_backward(
        q, k, v, o, do_fp8, stats, scales, amaxes, cfg.attn_scale, cfg.causal, cfg.segment_ids
    )
    for role, g in zip((AttnBwdRole.DQ, AttnBwdRole.DK, AttnBwdRole.DV), grads, strict=True):
        cfg.observe(role, g, "recorded")
    SCHEDULE.after_backward(cfg.backward_update)
    return list(grads), [bwd_inv[1:2], bwd_inv[2:3], bwd_inv[3:4]]


def _output(o: torch.Tensor, o_scale_inv: torch.Tensor, cfg: AttentionConfig, dtype):
    """O (B, S, H, D) FP8 -> (B, S, H * D): a Float8Tensor, or dequantized to `dtype`."""
    b, s, h, d = o.shape
    if cfg.fp8_output:
        return Float8Tensor(o.view(b, s, h * d), o_scale_inv, dtype)
    return ops.dequantize(o, o_scale_inv, dtype).view(b, s, h * d)


class _FP8AttentionQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, heads: tuple, cfg: AttentionConfig, needs_grad: bool):
        quantizers = [cfg.quantizer(r) for r in (AttnFwdRole.Q, AttnFwdRole.K, AttnFwdRole.V)]
        parts, scale_inv = ops.rope_fp8(qkv, cos, sin, heads[0], quantizers, heads[1])
        for role, part in zip((AttnFwdRole.Q, AttnFwdRole.K, AttnFwdRole.V), parts, strict=True):
            cfg.observe(role, part, "recorded")  # rotated in registers: never in memory
        o, o_scale_inv = _forward_core(ctx, parts, scale_inv, cfg, needs_grad)
        ctx.tables, ctx.dtype = (cos, sin), qkv.dtype
        return _output(o, o_scale_inv, cfg, qkv.dtype)

    @staticmethod
    def backward(ctx, grad):
        grads, scale_inv = _backward_core(ctx, grad)
        dqkv = ops.rope_fp8_backward(grads, scale_inv, *ctx.tables, ctx.dtype)
        return dqkv, None, None, None, None, None


class _FP8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: AttentionConfig, needs_grad: bool):
        roles = (AttnFwdRole.Q, AttnFwdRole.K, AttnFwdRole.V)
        inputs = [x.contiguous() for x in (q, k, v)]
        casts = [ops.cast_to_fp8(x, *cfg.quantizer(r)) for x, r in zip(inputs, roles, strict=True)]
        for x, r in zip(inputs, roles, strict=True):
            cfg.observe(r, x, "identity")
        o, o_scale_inv = _forward_core(
            ctx, [c[0] for c in casts], [c[1] for c in casts], cfg, needs_grad
        )
        ctx.dtype = q.dtype
        return _output(o, o_scale_inv, cfg, q.dtype)

    @staticmethod
    def backward(ctx, grad):
        grads, scale_inv = _backward_core(ctx, grad)
        out = [ops.dequantize(g, si, ctx.dtype) for g, si in zip(grads, scale_inv, strict=True)]
        return *out, None, None


def fp8_attention_qkv(qkv, rope_tables, heads: int, cfg: AttentionConfig,
                      kv_heads: int | None = None):  # fmt: skip
    """FP8 attention from a fused QKV projection, with RoPE fused into the casts.

    Args:
        qkv: (batch, seq, (heads + 2 * kv_heads) * head_dim) float32/bfloat16/float16: per
            token the q heads, then the k and the v heads (graphfp8.ops.rope_qkv's layout).
        rope_tables: (cos, sin) float32 (>= seq, head_dim), or None for no rotation.
        heads: query heads.
        cfg: slots, scale, mask and output form.
        kv_heads: key/value heads (grouped-query attention); None: heads.

    Returns:
        (batch, seq, heads * head_dim): a Float8Tensor of nominal dtype qkv.dtype when
        cfg.fp8_output, else a tensor of qkv.dtype.
    """
    cos, sin = rope_tables if rope_tables is not None else (None, None)
    if not qkv.is_contiguous():
        qkv = qkv.contiguous()
    needs_grad = torch.is_grad_enabled() and qkv.requires_grad
    return _FP8AttentionQKV.apply(qkv, cos, sin, (heads, kv_heads or heads), cfg, needs_grad)


def fp8_attention(q, k, v, cfg: AttentionConfig):
    """FP8 attention of separate q (batch, seq, heads, d) and k, v (batch, seq, kv_heads, d) in
    one high-precision dtype; returns (batch, seq, heads * d) like fp8_attention_qkv."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return _FP8Attention.apply(q, k, v, cfg, needs_grad)
