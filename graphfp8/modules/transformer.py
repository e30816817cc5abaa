"""graphfp8.TransformerLayer: pre-norm GPT block with FP8 GEMMs, rotary embeddings and SDPA.

    x (B, S, H) -> LayerNormLinear (QKV, FP8) -> RoPE on q, k -> causal SDPA -> Linear (proj, FP8)
      -> + x -> LayerNormMLP (FP8) -> + residual

(the second add folds into the next layer's first norm when layers hand it on: forward's
residual and defer_residual)

Under fp8_autocast both norms write their GEMM's FP8 input directly, and the first residual add
folds into the MLP's norm: one kernel reads x and the projection's output and writes h = x + proj
and the FP8 norm of h (graphfp8.modules._norm); its backward adds the gradient that reaches h
through the second residual into dx in the same pass.

Attention (graphfp8.DotProductAttention) runs in the parameter dtype (torch's flash / memory-
efficient kernels) by default, RoPE as one graphfp8 kernel each way (q and k rotated, v copied,
straight from the fused QKV output; as separate torch ops on the strided q/k views it was ~10
kernels and ~22% of the GPU time of a 100M-parameter model's microbatch on the H200). With a
recipe that sets fp8_dpa, attention runs in FP8 (cuDNN) and RoPE is fused into the FP8 casts of
q, k and v; with fp8_mha too, the attention output stays FP8 into the projection (no second
cast). Every per-step quantity lives on the device and the rotary tables are precomputed float32
buffers, so the layer captures into a CUDA graph (or the CPU replay tape) without host syncs.
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.modules._rope import RopeQKV as _RopeQKV  # noqa: F401 - kept importable here
from graphfp8.modules._rope import rope_tables
from graphfp8.modules.attention import DotProductAttention
from graphfp8.modules.layernorm_linear import LayerNormLinear
from graphfp8.modules.layernorm_mlp import LayerNormMLP
from graphfp8.modules.linear import InitMethod, Linear

__all__ = ["TransformerLayer", "rope_tables"]


class TransformerLayer(nn.Module):
    """One pre-norm transformer block whose four GEMMs run in FP8 under fp8_autocast.

    Args:
        hidden_size: H, a multiple of 16 for FP8 and of num_heads.
        num_heads: attention heads; head_dim = H / num_heads must be even for RoPE.
        ffn_hidden_size: F of the MLP, a multiple of 16 for FP8.
        rope: apply rotary position embeddings to q and k.
        max_seq_len: longest sequence the rotary tables cover.
        rope_base: rotary frequency base.
        eps, bias, activation, normalization, zero_centered_gamma: as for LayerNormMLP (shared
            by both norms).
        params_dtype, device: as for Linear.
        init_method: initialises the QKV and fc1 weights (biases then start at 0), as for Linear;
            None: torch.nn.Linear's initialisation.
        output_layer_init_method: the same for the projection and fc2 (default: init_method),
            TransformerEngine's names.
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, rope: bool = True,
                 max_seq_len: int = 2048, rope_base: float = 10000.0, eps: float = 1e-5,
                 bias: bool = True, activation: str = "gelu", normalization: str = "LayerNorm",
                 zero_centered_gamma: bool = False, params_dtype: torch.dtype | None = None,
                 device=None, init_method: InitMethod | None = None,
                 output_layer_init_method: InitMethod | None = None):  # fmt: skip
        super().__init__()
        if num_heads < 1 or hidden_size % num_heads:
            raise ValueError(
                f"TransformerLayer: hidden_size {hidden_size} must be a multiple of num_heads "
                f"{num_heads}"
            )
        head_dim = hidden_size // num_heads
        if rope and head_dim % 2:
            raise ValueError(f"TransformerLayer: RoPE needs an even head_dim, got {head_dim}")
        dtype = params_dtype or torch.get_default_dtype()
        kw = dict(eps=eps, bias=bias, normalization=normalization, params_dtype=dtype,
                  zero_centered_gamma=zero_centered_gamma, device=device)  # fmt: skip
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.ffn_hidden_size, self.rope, self.max_seq_len = ffn_hidden_size, rope, max_seq_len
        out_init = output_layer_init_method or init_method
        self.qkv = LayerNormLinear(hidden_size, 3 * hidden_size, init_method=init_method, **kw)
        self.core_attention = DotProductAttention(num_heads, head_dim, device=device)
        self.proj = Linear(hidden_size, hidden_size, bias=bias, params_dtype=dtype, device=device,
                           init_method=out_init)  # fmt: skip
        self.mlp = LayerNormMLP(hidden_size, ffn_hidden_size, activation=activation,
                                init_method=init_method, output_layer_init_method=out_init,
                                **kw)  # fmt: skip
        if rope:
            cos, sin = rope_tables(max_seq_len, head_dim, rope_base, torch.float32, device)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """Causal self-attention core with RoPE: qkv (B, S, 3H) -> (B, S, H), in qkv's dtype (a
        Float8Tensor under fp8_mha)."""
        tables = None
        if self.rope:  # the tables stay float32 even if the module was cast to another dtype
            tables = (self.rope_cos.float(), self.rope_sin.float())
        return self.core_attention.forward_qkv(qkv, tables)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None,
                residual: torch.Tensor | None = None, defer_residual: bool = False):  # fmt: skip
        """x: (B, S, H) in params_dtype, S <= max_seq_len. Returns (B, S, H).
        is_first_microbatch: as for Linear (all four weights).

        Consecutive layers can hand the second residual add on (training/model.py's Blocks):
        defer_residual returns (h, y) instead of h + y, and the next layer given residual=y
        takes x + residual as its input, the add folded into its first norm."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"TransformerLayer: expected input (batch, seq, {self.hidden_size}), got {shape}"
            )
        if self.rope and x.shape[1] > self.max_seq_len:
            raise ValueError(
                f"TransformerLayer: sequence length {x.shape[1]} exceeds max_seq_len "
                f"{self.max_seq_len} of the rotary tables"
            )
        self.core_attention.check_fused(x.shape[0], x.shape[1], x.device)
        if residual is None:
            qkv = self.qkv(x, is_first_microbatch=is_first_microbatch)
        else:
            x, qkv = self.qkv(x, is_first_microbatch=is_first_microbatch, residual=residual)
        attn = self.proj(self.attention(qkv), is_first_microbatch=is_first_microbatch)
        h, y = self.mlp(x, is_first_microbatch=is_first_microbatch, residual=attn)
        return (h, y) if defer_residual else h + y

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, rope={self.rope}"
        )
