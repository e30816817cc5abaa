"""graphfp8.te.TransformerLayer: TransformerEngine's TransformerLayer (constructor, module tree,
parameter names, sbhd layout, dropout) built from graphfp8's FP8 layers and attention.

    x -> self_attention (layernorm_qkv -> core_attention -> proj) -> dropout -> + x
      -> layernorm_mlp -> dropout -> + residual

as graphfp8.TransformerLayer computes it (the first residual add folded into the MLP's norm
under fp8_autocast), without RoPE (TE passes rotary embeddings per call, which graphfp8.te does
not support) and with TE's hidden_dropout / attention_dropout while training. The fused QKV
projection holds q of every head, then k, then v (TE's layout for fuse_qkv_params=False, or
qkv_weight_interleaved=False) in one `weight` (TE splits it into query_/key_/value_weight).
graphfp8 computes in (batch, seq, hidden): an sbhd input is transposed in and the output back
(one copy each way); attn_input_format="bshd" avoids both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphfp8 import modules
from graphfp8.te._args import PARALLEL, check_te_args, default_device
from graphfp8.te.attention import ATTN_FORWARD_TE_ONLY, ATTN_TE_ONLY, check_format, check_mask
from graphfp8.te.modules import LayerNormLinear, LayerNormMLP, Linear

__all__ = ["TransformerLayer"]

_LAYER_TE_ONLY = {
    **ATTN_TE_ONLY,
    **PARALLEL,
    "enc_dec_attn_mask_type": "no_mask",
    "enc_dec_bottom_right_diagonal": None,
    "enc_dec_window_size": None,
    "seq_length": None,
    "micro_batch_size": None,
    "apply_residual_connection_post_layernorm": False,
    "output_layernorm": False,
    "parallel_attention_mlp": False,
    "layer_type": "encoder",
    "drop_path_rate": 0.0,
    "set_parallel_mode": False,
    "rotary_pos_interleaved": False,
    "ub_tp_comm_overlap": False,
    "ub_overlap_ag": True,  # these four only act with ub_tp_comm_overlap=True
    "ub_overlap_rs": True,
    "ub_bulk_dgrad": True,
    "ub_bulk_wgrad": True,
    "ub_overlap_rs_dgrad": False,
    "activation_params": None,
    "qk_norm_type": None,
    "qk_norm_eps": 1e-6,
    "qk_norm_before_rope": False,
}
_LAYER_FORWARD_TE_ONLY = {
    **ATTN_FORWARD_TE_ONLY,
    **dict.fromkeys(
        [
            "encoder_output",
            "enc_dec_attn_mask",
            "enc_dec_attn_mask_type",
            "enc_dec_window_size",
            "enc_dec_bottom_right_diagonal",
            "rotary_pos_emb",
        ]
    ),  # fmt: skip
}


class _SelfAttention(nn.Module):
    """TE's MultiheadAttention for self-attention with an input norm: (batch, seq, hidden) ->
    layernorm_qkv -> core_attention -> proj -> (batch, seq, hidden)."""

    def __init__(self, hidden_size: int, heads: int, groups: int, head_dim: int,
                 attention_dropout: float, mask_type: str, init_method, output_layer_init_method,
                 bias: bool, norm: dict, common: dict):  # fmt: skip
        super().__init__()
        self.layernorm_qkv = LayerNormLinear(hidden_size, (heads + 2 * groups) * head_dim,
                                             init_method=init_method, bias=bias, **norm,
                                             **common)  # fmt: skip
        self.core_attention = modules.DotProductAttention(heads, head_dim, num_gqa_groups=groups,
                                                     attn_mask_type=mask_type,
                                                     attention_dropout=attention_dropout,
                                                     device=common["device"])  # fmt: skip
        self.proj = Linear(heads * head_dim, hidden_size, init_method=output_layer_init_method,
                           bias=bias, **common)  # fmt: skip

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """x: (batch, seq, hidden). Returns (batch, seq, hidden)."""
        qkv = self.layernorm_qkv(x, is_first_microbatch=is_first_microbatch)
        attn = self.core_attention.forward_qkv(qkv)
        return self.proj(attn, is_first_microbatch=is_first_microbatch)


class TransformerLayer(nn.Module):
    """TE's TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads, ...): a pre-norm
    self-attention block whose four GEMMs run in FP8 under fp8_autocast.

    Supported: num_gqa_groups, layernorm_epsilon, hidden_dropout, attention_dropout,
    init_method, output_layer_init_method, layer_number, kv_channels, self_attn_mask_type
    ("causal" or "no_mask"), params_dtype, zero_centered_gamma, bias, activation ("gelu",
    "relu", "swiglu", "geglu"), normalization, device, attn_input_format ("sbhd" or "bshd"),
    fuse_qkv_params (names only, see the module docstring), qkv_weight_interleaved=False,
    fuse_wgrad_accumulation (each GEMM weight's main_grad, as graphfp8.Linear's), name;
    TE's other arguments only at their defaults.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: int | None = None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1, init_method=None,
                 output_layer_init_method=None, layer_number: int | None = None,
                 kv_channels: int | None = None, self_attn_mask_type: str = "causal", *,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 bias: bool = True, activation: str = "gelu", normalization: str = "LayerNorm",
                 device=None, attn_input_format: str = "sbhd", fuse_qkv_params: bool = False,
                 qkv_weight_interleaved: bool = True, fuse_wgrad_accumulation: bool = False,
                 name: str | None = None, **te_only):  # fmt: skip
        super().__init__()
        check_te_args("TransformerLayer", te_only, _LAYER_TE_ONLY)
        check_format("TransformerLayer", "attn_input_format", attn_input_format)
        if fuse_qkv_params and qkv_weight_interleaved:
            raise NotImplementedError(
                "graphfp8.te.TransformerLayer: fuse_qkv_params=True with "
                "qkv_weight_interleaved=True (q, k, v interleaved per head) is not supported by "
                "graphfp8, whose attention reads q of every head, then k, then v: pass "
                "qkv_weight_interleaved=False"
            )
        if isinstance(hidden_dropout, bool) or not 0 <= hidden_dropout < 1:
            raise ValueError(
                f"graphfp8.te.TransformerLayer: hidden_dropout must be in [0, 1), got "
                f"{hidden_dropout!r}"
            )
        groups = num_gqa_groups or num_attention_heads
        common = dict(params_dtype=params_dtype, device=default_device(device),
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)  # fmt: skip
        norm = dict(eps=layernorm_epsilon, normalization=normalization,
                    zero_centered_gamma=zero_centered_gamma)  # fmt: skip
        self.self_attention = _SelfAttention(
            hidden_size, num_attention_heads, groups,
            kv_channels or hidden_size // num_attention_heads, attention_dropout,
            self_attn_mask_type, init_method, output_layer_init_method, bias, norm, common,
        )  # fmt: skip
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, init_method=init_method,
                                          output_layer_init_method=output_layer_init_method,
                                          bias=bias, activation=activation, **norm,
                                          **common)  # fmt: skip
        self.hidden_size, self.hidden_dropout = hidden_size, hidden_dropout
        self.attn_input_format, self.self_attn_mask_type = attn_input_format, self_attn_mask_type
        self.layer_number, self.name = layer_number, name

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                self_attn_mask_type: str | None = None, *,
                is_first_microbatch: bool | None = None, **te_only) -> torch.Tensor:  # fmt: skip
        """hidden_states: (seq, batch, hidden) for sbhd, (batch, seq, hidden) for bshd.
        is_first_microbatch: as for graphfp8.Linear (all four weights). Returns the same
        shape and dtype."""
        check_te_args("TransformerLayer.forward", te_only, _LAYER_FORWARD_TE_ONLY)
        check_mask("TransformerLayer.forward", attention_mask, self_attn_mask_type,
                   self.self_attn_mask_type)  # fmt: skip
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"graphfp8.te.TransformerLayer: expected hidden_states ({self.attn_input_format}"
                f") with hidden size {self.hidden_size}, got {tuple(hidden_states.shape)}"
            )
        sbhd = self.attn_input_format == "sbhd"
        x = hidden_states.transpose(0, 1).contiguous() if sbhd else hidden_states
        # FP8 attention that cannot run raises here, before any module's state changes.
        self.self_attention.core_attention.check_fused(x.shape[0], x.shape[1], x.device)
        attn = self._dropout(self.self_attention(x, is_first_microbatch))
        h, y = self.layernorm_mlp(x, is_first_microbatch=is_first_microbatch, residual=attn)
        out = h + self._dropout(y)
        return out.transpose(0, 1).contiguous() if sbhd else out

    def _dropout(self, t: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.hidden_dropout):
            return t
        return F.dropout(t, self.hidden_dropout, training=True)
