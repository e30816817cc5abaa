"""graphfp8.TransformerLayer: pre-norm GPT block with FP8 GEMMs, rotary embeddings and SDPA.

    x (B, S, H) -> LayerNormLinear (QKV, FP8) -> RoPE on q, k -> causal SDPA -> Linear (proj, FP8)
      -> + x -> LayerNormMLP (FP8) -> + residual

(the second add folds into the next layer's first norm when layers hand it on: forward's
residual and defer_residual)

Grouped-query attention (num_gqa_groups G < heads, TransformerEngine's name): the fused QKV
projection has (heads + 2 G) * head_dim outputs, per token the q heads, then the G k heads and
the G v heads (with G == heads the (3, heads, head_dim) layout); each k/v head serves
heads / G query heads. Llama-style blocks: normalization="RMSNorm", bias=False,
activation="swiglu".

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

Activation recompute (`recompute`, per layer; docs/fp8.md, "Activation recompute"): "full" keeps
only the layer's inputs and recomputes the whole layer in the backward, "selective" recomputes
the attention core (RoPE and attention from the QKV output) and the MLP's FP8 activation; both
through graphfp8.fp8.recompute, whose recomputed casts equal the forward's and change no FP8
state, eagerly and inside every capture entry point.
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8 import ops
from graphfp8.fp8.recompute import recompute as checkpointed
from graphfp8.modules._explicit_attention import KVCache, explicit_attention
from graphfp8.modules._qkv_rope import rope_cast_on
from graphfp8.modules._rope import RopeQKV as _RopeQKV  # noqa: F401 - kept importable here
from graphfp8.modules._rope import rope_tables
from graphfp8.modules.attention import DotProductAttention
from graphfp8.modules.layernorm_linear import LayerNormLinear
from graphfp8.modules.layernorm_mlp import LayerNormMLP
from graphfp8.modules.linear import InitMethod, Linear
from graphfp8.ops.segments import segment_mask

__all__ = ["RECOMPUTE_MODES", "TransformerLayer", "rope_tables"]

RECOMPUTE_MODES = ("none", "selective", "full")


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
        fuse_wgrad_accumulation: as for Linear, for the QKV, projection and MLP weights.
        init_method: initialises the QKV and fc1 weights (biases then start at 0), as for Linear;
            None: torch.nn.Linear's initialisation.
        output_layer_init_method: the same for the projection and fc2 (default: init_method),
            TransformerEngine's names.
        num_gqa_groups: key/value heads G (grouped-query attention); None: num_heads. num_heads
            must be a multiple of it.
        qkv_bias, mlp_bias: biases of the QKV projection and of the MLP when they differ from
            `bias` (which then covers the output projection): Qwen2 biases q, k, v only.
        softmax_scale: the attention's scale of q.k (default 1 / sqrt(head_dim)).
        recompute: activation recompute in training, one of RECOMPUTE_MODES: "none", "selective"
            (the attention core and the MLP's FP8 activation) or "full" (the whole layer); an
            attribute that can change between steps (not while a graph holds the layer).
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, rope: bool = True,
                 max_seq_len: int = 2048, rope_base: float = 10000.0, eps: float = 1e-5,
                 bias: bool = True, activation: str = "gelu", normalization: str = "LayerNorm",
                 zero_centered_gamma: bool = False, params_dtype: torch.dtype | None = None,
                 device=None, init_method: InitMethod | None = None,
                 output_layer_init_method: InitMethod | None = None,
                 num_gqa_groups: int | None = None, qkv_bias: bool | None = None,
                 mlp_bias: bool | None = None, softmax_scale: float | None = None,
                 recompute: str = "none", fuse_wgrad_accumulation: bool = False):  # fmt: skip
        super().__init__()
        if num_heads < 1 or hidden_size % num_heads:
            raise ValueError(
                f"TransformerLayer: hidden_size {hidden_size} must be a multiple of num_heads "
                f"{num_heads}"
            )
        groups = num_heads if num_gqa_groups is None else num_gqa_groups
        if groups < 1 or num_heads % groups:
            raise ValueError(
                f"TransformerLayer: num_heads {num_heads} must be a multiple of num_gqa_groups "
                f"{groups}"
            )
        head_dim = hidden_size // num_heads
        if rope and head_dim % 2:
            raise ValueError(f"TransformerLayer: RoPE needs an even head_dim, got {head_dim}")
        dtype = params_dtype or torch.get_default_dtype()
        kw = dict(eps=eps, normalization=normalization, params_dtype=dtype,
                  zero_centered_gamma=zero_centered_gamma, device=device,
                  fuse_wgrad_accumulation=fuse_wgrad_accumulation)  # fmt: skip
        qkv_bias = bias if qkv_bias is None else qkv_bias
        mlp_bias = bias if mlp_bias is None else mlp_bias
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_gqa_groups = groups
        self.ffn_hidden_size, self.rope, self.max_seq_len = ffn_hidden_size, rope, max_seq_len
        out_init = output_layer_init_method or init_method
        self.qkv = LayerNormLinear(hidden_size, (num_heads + 2 * groups) * head_dim, bias=qkv_bias,
                                   init_method=init_method, **kw)  # fmt: skip
        self.core_attention = DotProductAttention(num_heads, head_dim, num_gqa_groups=groups,
                                                  softmax_scale=softmax_scale,
                                                  device=device)  # fmt: skip
        self.proj = Linear(hidden_size, hidden_size, bias=bias, params_dtype=dtype, device=device,
                           init_method=out_init,
                           fuse_wgrad_accumulation=fuse_wgrad_accumulation)  # fmt: skip
        self.mlp = LayerNormMLP(hidden_size, ffn_hidden_size, activation=activation, bias=mlp_bias,
                                init_method=init_method, output_layer_init_method=out_init,
                                **kw)  # fmt: skip
        self.recompute = recompute
        if rope:
            cos, sin = rope_tables(max_seq_len, head_dim, rope_base, torch.float32, device)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def recompute(self) -> str:
        return self._recompute

    @recompute.setter
    def recompute(self, mode: str) -> None:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(
                f"TransformerLayer: recompute must be one of {RECOMPUTE_MODES}, got {mode!r}"
            )
        self._recompute = mode
        self.mlp.recompute_activation = mode == "selective"

    def attention(self, qkv: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Causal self-attention core with RoPE: qkv (B, S, (heads + 2 G) * head_dim) -> (B, S,
        H), in qkv's dtype (a Float8Tensor under fp8_mha); segment_ids as for forward()."""
        tables = None
        if self.rope:  # the tables stay float32 even if the module was cast to another dtype
            tables = (self.rope_cos.float(), self.rope_sin.float())
        return self.core_attention.forward_qkv(qkv, tables, segment_ids)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None,
                residual: torch.Tensor | None = None, defer_residual: bool = False,
                segment_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None):  # fmt: skip
        """x: (B, S, H) in params_dtype, S <= max_seq_len. Returns (B, S, H).
        is_first_microbatch: as for Linear (all four weights).
        segment_ids: optional (B, S) integer tensor on x's device: packed documents (or padding
        in a segment of its own), attention staying within each token's segment
        (graphfp8.ops.segments; a device tensor, so graphs replay it with each call's ids).
        position_ids, attn_mask, kv_cache: generation and explicit positions
        (modules/_explicit_attention.py): (B, S) int64 RoPE positions, a (B, 1, S, T) bool mask
        ANDed with causality, a KVCache holding the earlier tokens' keys and values; attention
        then runs as torch ops in the activations' dtype (not in FP8, not in a graph).

        Consecutive layers can hand the second residual add on (training/model.py's Blocks):
        defer_residual returns (h, y) instead of h + y, and the next layer given residual=y
        takes x + residual as its input, the add folded into its first norm."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"TransformerLayer: expected input (batch, seq, {self.hidden_size}), got {shape}"
            )
        explicit = not (position_ids is None and attn_mask is None and kv_cache is None)
        self._check_positions(x, position_ids, kv_cache)
        if explicit:
            self._check_explicit(segment_ids, kv_cache)
        else:
            self.core_attention.check_fused(x.shape[0], x.shape[1], x.device, segment_ids)
        args = (x, is_first_microbatch, residual, segment_ids, position_ids, attn_mask, kv_cache)
        # A KV cache grows in the forward: a recompute would append its tokens twice.
        if self.recompute == "full" and torch.is_grad_enabled() and kv_cache is None:
            h, y = checkpointed(self._body, *args)
        else:
            h, y = self._body(*args)
        return (h, y) if defer_residual else h + y

    def _body(self, x, is_first_microbatch, residual, segment_ids, position_ids, attn_mask,
              kv_cache) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The layer after its checks: (h, y), the second residual add left to the caller."""
        explicit = position_ids is not None or attn_mask is not None or kv_cache is not None
        rope = None if explicit else self._rope_cast(x, segment_ids)
        if residual is None:
            qkv = self.qkv(x, is_first_microbatch=is_first_microbatch, rope=rope)
        else:
            x, qkv = self.qkv(x, is_first_microbatch=is_first_microbatch, residual=residual,
                              rope=rope)  # fmt: skip
        if isinstance(qkv, tuple):  # q, k, v of the QKV projection fused with RoPE
            core = self.core_attention.sdpa_parts(*qkv, segment_ids)
        elif explicit:
            if segment_ids is not None:
                same = segment_mask(segment_ids, causal=False)
                attn_mask = same if attn_mask is None else attn_mask & same
            core = explicit_attention(self, qkv, position_ids, attn_mask, kv_cache)
        elif self.recompute == "selective" and torch.is_grad_enabled():
            core = checkpointed(self.attention, qkv, segment_ids)
        else:
            core = self.attention(qkv, segment_ids)
        attn = self.proj(core, is_first_microbatch=is_first_microbatch)
        return self.mlp(x, is_first_microbatch=is_first_microbatch, residual=attn)

    def _rope_cast(self, x: torch.Tensor, segment_ids) -> tuple | None:
        """(cos, sin, heads, kv_heads) for the QKV projection fused with RoPE (kernel switch
        ROPE_CAST_BWD, modules/_qkv_rope.py: the backward casts the QKV gradient from dq, dk, dv)
        where the layer would take RopeQKVParts and torch's SDPA, or None."""
        attn = self.core_attention
        h, g, d = self.num_heads, attn.num_gqa_groups, attn.kv_channels
        shape, weight = (*x.shape[:2], h, d), self.qkv.weight
        if not (self.rope and rope_cast_on() and torch.is_grad_enabled() and weight.requires_grad
                and self.recompute != "selective" and not attn.fp8_active(segment_ids)
                and ops.rope_cast_fits(shape, g, weight.dtype, x.device)):  # fmt: skip
            return None
        return self.rope_cos.float(), self.rope_sin.float(), h, g

    def _check_positions(self, x: torch.Tensor, position_ids, kv_cache) -> None:
        """Every position must have a row of the rotary tables (reads position_ids' maximum)."""
        if not self.rope:
            return
        cached = kv_cache.length() if kv_cache is not None else 0
        last, what = x.shape[1] + cached, "sequence length"
        if cached:
            what = f"sequence length ({cached} cached tokens and {x.shape[1]} new)"
        if position_ids is not None:
            last, what = int(position_ids.max()) + 1, "largest position_id + 1"
        if last > self.max_seq_len:
            raise ValueError(
                f"TransformerLayer: {what} {last} exceeds max_seq_len {self.max_seq_len} of the "
                "rotary tables"
            )

    def _check_explicit(self, segment_ids, kv_cache) -> None:
        # An eval-mode call (generate()) runs it in high precision: a frozen call leaves the FP8
        # attention's slots as they were either way (docs/fp8.md, "Evaluation").
        if self.core_attention.fp8_active() and self.training:
            raise ValueError(
                "TransformerLayer: position_ids, attn_mask and kv_cache run attention in high "
                "precision; FP8 attention (a recipe with fp8_dpa) has no such path in training: "
                "use a recipe without fp8_dpa, or call model.eval() for evaluation and "
                "generate() (which then run this path in high precision)"
            )
        if segment_ids is not None and kv_cache is not None:
            raise ValueError(
                "TransformerLayer: segment_ids with a kv_cache: pass the mask over the cached "
                "tokens as attn_mask instead"
            )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"num_gqa_groups={self.num_gqa_groups}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"rope={self.rope}, recompute={self.recompute}"
        )
