"""The model shapes graphfp8-train trains (`--preset`), as plain data: one frozen ModelConfig each.

Nothing here builds a model: the floor model (training/floor.py) reads the shapes without torch
modules, and training/model.py builds the GPT of a ModelConfig. The Llama 3 presets take their
widths from the memory planner's table (graphfp8/memory/shapes.py's LLAMA, the one place they are
written) and add the batch shape and learning rate a run needs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from graphfp8.memory.shapes import LLAMA

__all__ = ["BYTE_VOCAB", "ModelConfig", "PRESETS"]

BYTE_VOCAB = 256  # text read as bytes


@dataclass(frozen=True)
class ModelConfig:
    """Model shape and the per-microbatch batch of a preset."""

    hidden: int
    heads: int
    ffn: int
    layers: int
    seq_len: int
    batch: int  # sequences per microbatch
    lr: float
    vocab: int = BYTE_VOCAB  # a token file's --vocab-size replaces it (model_config says when)
    kv_heads: int | None = None  # grouped-query attention's key/value heads (None: heads)
    activation: str = "gelu"  # LayerNormMLP's: gelu, swiglu, ...
    norm: str = "LayerNorm"  # LayerNorm or RMSNorm, in the blocks and before the head
    bias: bool = True  # biases in the blocks' linear layers
    tie_embeddings: bool = False  # the head's weight is the embedding's (Llama-3.2-1B)

    def to_dict(self) -> dict:
        """The fields, less those added after 2026-12-01 while at their defaults: checkpoints of
        the GPT presets written before they existed record the same dict, so they resume."""
        return {k: v for k, v in asdict(self).items() if _NEWER.get(k, _UNSET) != v}

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_width(self) -> int:
        """Outputs of the fused q/k/v projection: (heads + 2 kv_heads) * head_dim."""
        return (self.heads + 2 * (self.kv_heads or self.heads)) * self.head_dim

    @property
    def gated(self) -> bool:
        """Whether the MLP's first GEMM has two halves (SwiGLU, GeGLU)."""
        return self.activation.endswith("glu")


_UNSET = object()
_NEWER = {"kv_heads": None, "activation": "gelu", "norm": "LayerNorm", "bias": True,
          "tie_embeddings": False}  # fmt: skip
_LLAMA = dict(activation="swiglu", norm="RMSNorm", bias=False)


def _llama(name: str, seq_len: int, batch: int, lr: float) -> ModelConfig:
    """The preset of LLAMA[name]'s shape (Llama 3's 128256-token vocabulary) at this batch."""
    s = LLAMA[name]
    return ModelConfig(hidden=s.hidden, heads=s.heads, ffn=s.ffn, layers=s.layers, seq_len=seq_len,
                       batch=batch, lr=lr, vocab=s.vocab, kv_heads=s.kv_heads,
                       activation=s.activation, norm=s.norm, bias=s.bias,
                       tie_embeddings=s.tied)  # fmt: skip


PRESETS = {
    # CPU default: the whole run (FP8, CPU replay tape) in well under two minutes on 2 cores.
    "tiny": ModelConfig(hidden=64, heads=4, ffn=256, layers=2, seq_len=64, batch=8, lr=3e-3),
    "small": ModelConfig(hidden=256, heads=4, ffn=1024, layers=4, seq_len=256, batch=8, lr=1e-3),
    # GPU default, 101M parameters.
    "100m": ModelConfig(
        hidden=1024, heads=16, ffn=4096, layers=8, seq_len=1024, batch=8, lr=6e-4
    ),  # fmt: skip
    "300m": ModelConfig(
        hidden=1024, heads=16, ffn=4096, layers=24, seq_len=1024, batch=8, lr=3e-4
    ),  # fmt: skip
    # Llama-style blocks: RMSNorm, 4 key/value heads for 16 (head_dim 64), SwiGLU of F = 2816
    # (~8/3 h), no biases, RoPE. 102M parameters, the 100m preset's depth plus one.
    "llama-100m": ModelConfig(
        hidden=1024,
        heads=16,
        ffn=2816,
        layers=9,
        seq_len=1024,
        batch=8,
        lr=6e-4,
        kv_heads=4,
        **_LLAMA,
    ),  # fmt: skip
    # The same block at the tiny preset's size (CPU runs and tests).
    "llama-tiny": ModelConfig(
        hidden=64, heads=4, ffn=176, layers=2, seq_len=64, batch=8, lr=3e-3, kv_heads=2, **_LLAMA
    ),  # fmt: skip
    # Llama-3.2-1B's shapes (1,235,814,400 parameters, tied embeddings) at B2 x S4096.
    "llama-1b": _llama("llama-1b", seq_len=4096, batch=2, lr=3e-4),
    # Llama-3-8B's shapes (8,030,261,248 parameters) at B1 x S8192; --layers N for one GPU.
    "llama-8b": _llama("llama-8b", seq_len=8192, batch=1, lr=1.5e-4),
}
