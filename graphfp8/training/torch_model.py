"""graphfp8-train's GPT (training/model.py) in plain torch - nn.Linear, nn.LayerNorm / nn.RMSNorm
(F.layer_norm / F.rms_norm), RoPE, causal scaled_dot_product_attention with grouped-query heads,
SwiGLU or GELU - for the peers that need torch modules: graphfp8-train's compiled bf16 baseline
(`--compare bf16:compile`, training/run.py), torch FSDP2 in bf16 and torchao's float8 training
(benchmarks/fsdp_peers.py). The same shapes for a ModelConfig (fused q/k/v projection with
grouped-query heads, GELU (tanh) or SwiGLU MLP, biases or not, tied embeddings or not), the same
initialisation (normal(0, 0.02), biases 0), not the same numbers (no FP8, other kernels).

    tokens (B, S) int64 -> Embedding -> TorchBlock x layers -> norm -> head -> cross entropy
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphfp8.training.model import INIT_STD
from graphfp8.training.presets import ModelConfig

__all__ = ["TorchBlock", "TorchGPT"]


def _norm(cfg: ModelConfig, dtype, device) -> nn.Module:
    norm = nn.RMSNorm if cfg.norm == "RMSNorm" else nn.LayerNorm
    return norm(cfg.hidden, eps=1e-5, dtype=dtype, device=device)


def _rope_tables(seq: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (S, head_dim / 2) float32 of the rotary angles (base 10000)."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, S, D); the two halves of D rotated by the angles (in x's dtype)."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class TorchBlock(nn.Module):
    """Pre-norm transformer block: x + proj(attention(rope(qkv(norm(x))))), then
    x + fc2(act(fc1(norm(x)))). x: (B, S, H) -> (B, S, H)."""

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device=None):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads or cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        kv = self.kv_heads * self.head_dim
        kw = dict(dtype=dtype, device=device)
        self.norm1, self.norm2 = _norm(cfg, dtype, device), _norm(cfg, dtype, device)
        self.qkv = nn.Linear(cfg.hidden, cfg.hidden + 2 * kv, bias=cfg.bias, **kw)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias, **kw)
        self.gated = cfg.activation == "swiglu"
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn * (2 if self.gated else 1), bias=cfg.bias, **kw)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias, **kw)
        cos, sin = _rope_tables(cfg.seq_len, self.head_dim, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for linear in (self.qkv, self.proj, self.fc1, self.fc2):
            nn.init.normal_(linear.weight, std=INIT_STD)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim,
                                     self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], dim=-1)  # fmt: skip
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.kv_heads != self.heads)  # fmt: skip
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.norm1(x))
        h = self.fc1(self.norm2(x))
        if self.gated:
            g, u = h.chunk(2, dim=-1)
            h = F.silu(g) * u
        else:
            h = F.gelu(h, approximate="tanh")
        return x + self.fc2(h)


class TorchGPT(nn.Module):
    """The GPT of a ModelConfig in torch modules; forward(tokens, targets) is the mean cross
    entropy (float32).

    Args:
        cfg: the preset's shape.
        dtype: parameter dtype (float32: FSDP2's MixedPrecisionPolicy casts to bf16 per block;
            bf16: graphfp8-train's compiled baseline).
        device: where the parameters live.
    """

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device=None):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(TorchBlock(cfg, dtype, device) for _ in range(cfg.layers))
        self.norm = _norm(cfg, dtype, device)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dtype, device=device)
        nn.init.normal_(self.embed.weight, std=INIT_STD)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        else:
            nn.init.normal_(self.head.weight, std=INIT_STD)

    def hidden(self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, S) int64 -> the blocks' output (B, S, H)."""
        if segment_ids is not None:
            raise ValueError("TorchGPT attends causally over whole rows: packed documents "
                             "(segment_ids, --pack) are graphfp8's GPT only")  # fmt: skip
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden: (B, S, H); targets: (B, S) int64. Cross entropy per token, (B, S) float32."""
        logits = self.head(self.norm(hidden)).float()
        losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                                 reduction="none")  # fmt: skip
        return losses.view(targets.shape)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """tokens, targets: (B, S) int64. Returns the mean cross entropy, float32."""
        logits = self.head(self.norm(self.hidden(tokens))).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
