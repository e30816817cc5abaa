"""graphfp8.DotProductAttention: scaled dot-product attention, in FP8 through cuDNN under a recipe
with fp8_dpa (graphfp8.modules._attention), else torch's SDPA in the inputs' dtype.

Packed batches (segment_ids) run torch's SDPA with the segment mask even under fp8_dpa, on every
device: cuDNN's FP8 attention over packed sequences (the ragged "thd" layout,
graphfp8.ops.cudnn_ragged) has no backward on Hopper (the cuDNN frontend refuses it since 1.22:
"sdpa fp8 backward with THD is not supported on Hopper architecture"), and its forward stopped
with an illegal instruction on the H200. GRAPHFP8_CUDNN_RAGGED=1 runs them in FP8 instead (the
CPU emulation, cuDNN's ragged graphs on the GPU) where cuDNN supports it. The rule is the same on
the CPU, so CPU tests cover what a GPU runs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphfp8.fp8.recipe import DelayedScaling
from graphfp8.fp8.slots import AttnBwdRole, AttnFwdRole
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.modules._attention import (
    AttentionConfig,
    fp8_attention,
    fp8_attention_qkv,
    prepare_attention,
)
from graphfp8.modules._context import fp8_recipe, fp8_slots, frozen_call
from graphfp8.modules._rope import RopeQKV, RopeQKVParts, rope_parts_backward
from graphfp8.modules.base import FP8Module
from graphfp8.ops import cudnn_ragged
from graphfp8.ops.segments import segment_mask

__all__ = ["DotProductAttention"]

MASK_TYPES = ("causal", "no_mask")
_HP = (torch.float32, torch.bfloat16, torch.float16)


class DotProductAttention(FP8Module):
    """softmax(Q K^T * softmax_scale (+ causal mask)) V per head, TransformerEngine's core
    attention. Under fp8_autocast with a recipe that sets fp8_dpa it runs in FP8 (cuDNN on the
    GPU, an emulation with the same quantization points on the CPU): its Q, K, V, S, O, dO, dP,
    dQ, dK, dV scales are slots in the arenas (graphfp8.fp8.slots.AttnFwdRole / AttnBwdRole), so
    the fused scale update, the amax reduction, graphs and checkpoints cover them. With fp8_mha
    too the output is a Float8Tensor that a following graphfp8 layer consumes without a cast.

    Args:
        num_attention_heads: query heads H.
        kv_channels: head_dim D (FP8: a multiple of 16, at most 128).
        num_gqa_groups: key/value heads G (default H); H must be a multiple of G.
        attn_mask_type: "causal" (default) or "no_mask" (not in FP8).
        qkv_format: "bshd", the only layout: (batch, seq, heads, head_dim).
        softmax_scale: default 1 / sqrt(D).
        attention_dropout: dropout probability on the attention weights while training
            (torch's SDPA draws it from torch's generator, which graphs replay graph-safely:
            graphed == eager bit for bit); not in FP8 attention, which raises.
        device: where the FP8 state lives (the layer has no parameters; .to() moves it).
    """

    num_gemms = 0

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: int | None = None,
        attn_mask_type: str = "causal",
        qkv_format: str = "bshd",
        softmax_scale: float | None = None,
        attention_dropout: float = 0.0,
        device=None,
    ):
        super().__init__()
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        _check_config(
            num_attention_heads, kv_channels, groups, attn_mask_type, qkv_format, attention_dropout
        )
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        self.num_gqa_groups, self.attn_mask_type = groups, attn_mask_type
        self.qkv_format, self.softmax_scale = qkv_format, softmax_scale
        self.attention_dropout = float(attention_dropout)
        # torch's SDPA computes its default scale as 1 / sqrt(D) in double; so does FP8.
        self.attn_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        )
        self.register_buffer("_device_anchor", torch.empty(0, device=device), persistent=False)

    # FP8 state ---------------------------------------------------------------------------------

    def uses_fp8(self, recipe: DelayedScaling) -> bool:
        return recipe.fp8_dpa

    def _slot_counts(self) -> tuple[int, int]:
        return len(AttnFwdRole), len(AttnBwdRole)

    def fp8_active(self, segment_ids=None) -> bool:
        """Whether a call (with those segment_ids) now runs in FP8: fp8_autocast with a recipe
        that sets fp8_dpa, and no segment ids unless GRAPHFP8_CUDNN_RAGGED=1 (the module
        docstring says why)."""
        recipe = fp8_recipe()
        fp8 = recipe is not None and recipe.fp8_dpa
        return fp8 and (segment_ids is None or cudnn_ragged.ENABLED)

    def _fp8_config(self, q_shape, kv_shape, device, training: bool,
                    segment_ids=None) -> AttentionConfig:  # fmt: skip
        recipe, causal = fp8_recipe(), self.attn_mask_type == "causal"
        self._check_fp8_dropout()
        prepare_attention(q_shape, kv_shape, device, recipe, self.attn_scale, causal, training,
                          segment_ids is not None)  # fmt: skip
        # State changes only after the checks; an eval-mode call (an evaluation forward,
        # generate(), a validation loop) is frozen like the GEMMs' (docs/fp8.md, "Evaluation"):
        # current scales, amaxes into the arena's sink, no scale update.
        fwd, bwd, bwd_update = fp8_slots(self, device, frozen_call(self))
        return AttentionConfig(fwd, bwd, self.attn_scale, causal, recipe.fp8_mha, bwd_update,
                               segment_ids, recipe.fp8_dpa_e4m3_bwd)  # fmt: skip

    def check_fused(self, batch: int, seq: int, device, segment_ids=None) -> None:
        """For a layer that calls forward_qkv after other work (TransformerLayer): raises now if
        the FP8 attention of a (batch, seq) input (with those segment_ids) would not run (and
        builds its cuDNN graphs), so the layer fails before any of its state changes. Checks
        segment_ids in any precision; otherwise a no-op outside FP8 attention."""
        _check_segments(segment_ids, batch, seq, device)
        if self.fp8_active(segment_ids):
            self._check_fp8_dropout()
            h, g, d = self.num_attention_heads, self.num_gqa_groups, self.kv_channels
            causal = self.attn_mask_type == "causal"
            prepare_attention((batch, seq, h, d), (batch, seq, g, d), device, fp8_recipe(),
                              self.attn_scale, causal, torch.is_grad_enabled(),
                              segment_ids is not None)  # fmt: skip

    def _check_fp8_dropout(self) -> None:
        if self.attention_dropout and self.training:
            raise ValueError(
                f"DotProductAttention: attention_dropout={self.attention_dropout} in training "
                "mode, but FP8 attention (a recipe with fp8_dpa) has no dropout: use dropout 0, "
                "eval mode or a recipe without fp8_dpa"
            )

    # Forward -----------------------------------------------------------------------------------

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                segment_ids: torch.Tensor | None = None):  # fmt: skip
        """query: (batch, seq, H, D); key, value: (batch, seq, G, D); one float dtype and device.
        segment_ids: optional (batch, seq) integer tensor on that device: packed documents or
        padding, each token attending only within its segment (graphfp8.ops.segments).

        Returns (batch, seq, H * D) in the inputs' dtype (a Float8Tensor of that nominal dtype
        under fp8_mha).
        """
        self._check_qkv(query, key, value)
        _check_segments(segment_ids, query.shape[0], query.shape[1], query.device)
        if self.fp8_active(segment_ids):
            training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            cfg = self._fp8_config(query.shape, key.shape, query.device, training, segment_ids)
            return fp8_attention(query, key, value, cfg)
        return self._sdpa(query, key, value, segment_ids)

    def forward_qkv(self, qkv: torch.Tensor, rope_tables=None, segment_ids=None):
        """Attention straight from a fused QKV projection (TransformerLayer): in FP8 the rotary
        embedding is fused into the casts of q, k and v (graphfp8.ops.rope_fp8).

        Args:
            qkv: (batch, seq, (H + 2 G) * D): per token the H query heads, then the G key heads
                and the G value heads (G == H: the (batch, seq, 3, H, D) layout).
            rope_tables: (cos, sin), float32 (>= seq, D) rotary tables for q and k, or None.
            segment_ids: as for forward().

        Returns:
            (batch, seq, H * D), as forward().
        """
        h, g, d = self.num_attention_heads, self.num_gqa_groups, self.kv_channels
        width = (h + 2 * g) * d
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3 or qkv.shape[-1] != width:
            shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
            raise ValueError(
                f"DotProductAttention: expected qkv (batch, seq, {width}), got {shape}"
            )
        _check_tensor("qkv", qkv)
        b, s, _ = qkv.shape
        _check_segments(segment_ids, b, s, qkv.device)
        if self.fp8_active(segment_ids):
            training = torch.is_grad_enabled() and qkv.requires_grad
            cfg = self._fp8_config((b, s, h, d), (b, s, g, d), qkv.device, training, segment_ids)
            return fp8_attention_qkv(qkv, rope_tables, h, cfg, g)
        if rope_tables is not None and rope_parts_backward(qkv.device):
            # the backward writes dqkv from dq, dk, dv in one kernel (no cat of the three)
            q, k, v = RopeQKVParts.apply(qkv.contiguous(), *rope_tables, h, g)
            return self._sdpa(q, k, v, segment_ids)
        if rope_tables is not None:
            qkv = RopeQKV.apply(qkv.contiguous(), *rope_tables, h, g)
        q, k, v = qkv.view(b, s, h + 2 * g, d).split([h, g, g], dim=2)
        return self._sdpa(q, k, v, segment_ids)

    def sdpa_parts(self, q, k, v, segment_ids=None) -> torch.Tensor:
        """torch's SDPA of q (batch, seq, H, D), k, v (batch, seq, G, D) already rotated, as
        forward_qkv runs it after RoPE (TransformerLayer's QKV projection fused with RoPE,
        modules/_qkv_rope.py); returns (batch, seq, H * D)."""
        return self._sdpa(q, k, v, segment_ids)

    def _sdpa(self, q, k, v, segment_ids=None) -> torch.Tensor:
        b, s, h, d = q.shape
        causal = self.attn_mask_type == "causal"
        mask = None if segment_ids is None else segment_mask(segment_ids, causal)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=causal and mask is None,
            scale=self.softmax_scale,
            enable_gqa=self.num_gqa_groups != h,
        )
        return out.transpose(1, 2).reshape(b, s, h * d)

    def _check_qkv(self, q, k, v) -> None:
        h, g, d = self.num_attention_heads, self.num_gqa_groups, self.kv_channels
        for name, t in (("query", q), ("key", k), ("value", v)):
            _check_tensor(name, t)
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(
                    "DotProductAttention: query, key and value must share dtype and "
                    f"device, got {q.dtype}/{q.device} and {t.dtype}/{t.device}"
                )
        want = {"query": (h, d), "key": (g, d), "value": (g, d)}
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.dim() != 4 or tuple(t.shape[2:]) != want[name] or t.shape[:2] != q.shape[:2]:
                raise ValueError(
                    f"DotProductAttention: expected {name} (batch, seq, "
                    f"{want[name][0]}, {d}) in the bshd layout matching query's "
                    f"(batch, seq), got {tuple(t.shape)}"
                )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints of TransformerLayer from before it had this submodule hold no FP8 state
        # for it: load them as a layer that never ran in FP8.
        state_dict.setdefault(prefix + "_extra_state", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_attention_heads}, head_dim={self.kv_channels}, "
            f"gqa_groups={self.num_gqa_groups}, mask={self.attn_mask_type}, "
            f"dropout={self.attention_dropout}"
        )


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"DotProductAttention: {name} must be a tensor, got {type(t).__name__}")
    if isinstance(t, Float8Tensor) or t.dtype not in _HP:
        raise TypeError(
            f"DotProductAttention: {name} must be float32, bfloat16 or float16 (not "
            f"FP8), got {t.dtype}"
        )


def _check_segments(segment_ids, batch: int, seq: int, device) -> None:
    if segment_ids is None:
        return
    if not isinstance(segment_ids, torch.Tensor):
        raise TypeError(
            f"DotProductAttention: segment_ids must be a tensor, got {type(segment_ids).__name__}"
        )
    if (
        segment_ids.dtype.is_floating_point
        or segment_ids.dtype == torch.bool
        or tuple(segment_ids.shape) != (batch, seq)
        or segment_ids.device != torch.device(device)
    ):
        raise ValueError(
            f"DotProductAttention: segment_ids must be an integer (batch, seq) = {(batch, seq)} "
            f"tensor on {device}, got {segment_ids.dtype} {tuple(segment_ids.shape)} on "
            f"{segment_ids.device}"
        )


def _check_config(heads, head_dim, groups, mask, layout, dropout) -> None:
    name = "DotProductAttention"
    if heads < 1 or head_dim < 1 or groups < 1 or heads % groups:
        raise ValueError(
            f"{name}: num_attention_heads ({heads}) must be a positive multiple of "
            f"num_gqa_groups ({groups}), kv_channels ({head_dim}) positive"
        )
    if mask not in MASK_TYPES:
        raise ValueError(f"{name}: attn_mask_type must be one of {MASK_TYPES}, got {mask!r}")
    if layout != "bshd":
        raise ValueError(
            f"{name}: qkv_format must be 'bshd' (batch, seq, heads, head_dim), got {layout!r}"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{name}: attention_dropout must be a number in [0, 1), got {dropout!r}")
