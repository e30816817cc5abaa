"""graphfp8.te.DotProductAttention: TransformerEngine's constructor, layouts (sbhd by default)
and forward arguments over graphfp8's DotProductAttention, and the attention arguments that
graphfp8.te.TransformerLayer shares with it.

graphfp8 computes in (batch, seq, ...): sbhd inputs are transposed in and the output back (a
copy); qkv_format="bshd" avoids it.
"""

from __future__ import annotations

import torch

from graphfp8 import modules
from graphfp8.fp8 import Float8Tensor
from graphfp8.te._args import check_te_args, default_device

__all__ = [
    "ATTN_TE_ONLY",
    "ATTN_FORWARD_TE_ONLY",
    "DotProductAttention",
    "check_format",
    "check_mask",
]

_FORMATS = ("sbhd", "bshd")
# TE's arguments shared by DotProductAttention and TransformerLayer: sliding windows, softcap,
# other softmax types.
ATTN_TE_ONLY = {"window_size": None, "bottom_right_diagonal": None, "softcap": 0.0,
                 "softmax_type": "vanilla"}  # fmt: skip
_DPA_TE_ONLY = {
    **ATTN_TE_ONLY,
    "sequence_parallel": False,
    "tp_size": 1,
    "get_rng_state_tracker": None,
    "tp_group": None,
    "attention_type": "self",
    "cp_group": None,
    "cp_global_ranks": None,
    "cp_stream": None,
    "cp_comm_type": "p2p",
    "return_max_logit": False,
}
# forward: variable lengths (thd, cu_seqlens), biases, KV cache, score modifiers, FP8 hand-off.
_VARLEN = dict.fromkeys(["cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                         "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv",
                         "pad_between_seqs", "thd_attention_policies"])  # fmt: skip
ATTN_FORWARD_TE_ONLY = {
    **_VARLEN,
    "thd_attention_policy_dispatch": "auto",
    "window_size": None,
    "bottom_right_diagonal": None,
    "softcap": None,
    "checkpoint_core_attention": False,
    "core_attention_bias_type": "no_bias",
    "core_attention_bias": None,
    "alibi_slopes": None,
    "fast_zero_fill": True,
    "inference_params": None,
}
_DPA_FORWARD_TE_ONLY = {
    **ATTN_FORWARD_TE_ONLY,
    "fp8_output": False,
    "bf16_backward": False,
    "num_splits": 1,
    **dict.fromkeys(
        [
            "score_mod",
            "score_mod_bprop",
            "score_mod_tensors",
            "score_mod_bprop_tensors",
            "qkv_layer",
            "kv_layer",
        ]
    ),  # fmt: skip
    "qkv_interleave_dim": -3,
}


def check_format(where: str, name: str, value: str) -> None:
    if value not in _FORMATS:
        raise NotImplementedError(
            f"graphfp8.te.{where}: {name}={value!r} is not supported by graphfp8 (sbhd or bshd)"
        )


def check_mask(where: str, attention_mask, mask_type, module_mask_type: str) -> None:
    """graphfp8's attention is causal or unmasked, fixed at construction."""
    if attention_mask is not None:
        raise NotImplementedError(
            f"graphfp8.te.{where}: attention_mask is not supported by graphfp8 (its attention "
            "is 'causal' or 'no_mask'; packed documents: graphfp8.DotProductAttention's "
            "segment_ids)"
        )
    if mask_type is not None and mask_type != module_mask_type:
        raise NotImplementedError(
            f"graphfp8.te.{where}: a per-call mask type {mask_type!r} other than the module's "
            f"{module_mask_type!r} is not supported by graphfp8"
        )


class DotProductAttention(modules.DotProductAttention):
    """TE's DotProductAttention(num_attention_heads, kv_channels, num_gqa_groups,
    attention_dropout, qkv_format="sbhd", attn_mask_type="causal", ...): graphfp8's.

    Supported: qkv_format "sbhd" (q: (seq, batch, heads, head_dim), out: (seq, batch, heads *
    head_dim)) or "bshd", attn_mask_type "causal" or "no_mask", softmax_scale, layer_number
    (TE uses it only for KV caches and an optional rescaling that cancels out), name. Under a
    recipe with fp8_mha the output is returned in high precision, as TE's fp8_output=False.
    """

    def __init__(self, num_attention_heads: int, kv_channels: int,
                 num_gqa_groups: int | None = None, attention_dropout: float = 0.0,
                 qkv_format: str = "sbhd", attn_mask_type: str = "causal", *,
                 softmax_scale: float | None = None, layer_number: int | None = None,
                 name: str | None = None, device=None, **te_only):  # fmt: skip
        check_te_args("DotProductAttention", te_only, _DPA_TE_ONLY)
        check_format("DotProductAttention", "qkv_format", qkv_format)
        if not isinstance(kv_channels, int):
            raise NotImplementedError(
                "graphfp8.te.DotProductAttention: kv_channels must be one int (different key "
                f"and value head sizes are not supported by graphfp8), got {kv_channels!r}"
            )
        super().__init__(num_attention_heads, kv_channels, num_gqa_groups=num_gqa_groups,
                         attn_mask_type=attn_mask_type, softmax_scale=softmax_scale,
                         attention_dropout=attention_dropout,
                         device=default_device(device))  # fmt: skip
        self.te_qkv_format, self.layer_number, self.name = qkv_format, layer_number, name

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask=None, qkv_format: str | None = None,
                attn_mask_type: str | None = None, **te_only) -> torch.Tensor:  # fmt: skip
        """query_layer: (seq, batch, H, D) for sbhd, (batch, seq, H, D) for bshd; key_layer,
        value_layer: the same with G heads. Returns (seq, batch, H * D) / (batch, seq, H * D)
        in the inputs' dtype."""
        check_te_args("DotProductAttention.forward", te_only, _DPA_FORWARD_TE_ONLY)
        check_mask("DotProductAttention.forward", attention_mask, attn_mask_type,
                    self.attn_mask_type)  # fmt: skip
        fmt = qkv_format or self.te_qkv_format
        check_format("DotProductAttention.forward", "qkv_format", fmt)
        qkv = (query_layer, key_layer, value_layer)
        if fmt == "sbhd":
            qkv = tuple(t.transpose(0, 1) for t in qkv)
        out = super().forward(*qkv)
        if isinstance(out, Float8Tensor):  # fp8_mha: TE hands FP8 on only with fp8_output
            out = out.dequantize()
        return out.transpose(0, 1).contiguous() if fmt == "sbhd" else out
