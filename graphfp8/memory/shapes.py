"""Model shapes for the memory planner: the Llama-3 presets (llama-1b, llama-8b, llama-70b) in one
table, and any graphfp8-train preset (graphfp8/training/model.py) seen as a shape (shape_from).

The Llama table is the one place their shapes are written: the training app's presets of those
names take their widths from it (graphfp8/training/presets.py; docs/sharding.md, "Memory
planner")."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LLAMA", "ModelShape", "shape_from", "shape_of"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (graphfp8 TransformerLayers, RoPE, no learned positions).

    Attributes:
        hidden: H; heads, kv_heads: query and key/value heads (head_dim = H / heads).
        ffn: F of the MLP (the gated activations' fc1 has 2 F outputs).
        layers: transformer layers; vocab: embedding rows.
        activation: "gelu", "swiglu", ...; norm: "LayerNorm" or "RMSNorm"; bias: linear biases.
        tied: the LM head shares the embedding's weight.
    """

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int
    activation: str = "swiglu"
    norm: str = "RMSNorm"
    bias: bool = False
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    @property
    def fc1_out(self) -> int:
        return 2 * self.ffn if self.gated else self.ffn

    def fp8_layer_params(self) -> int:
        """Elements of one layer's four FP8 GEMM weights (QKV, projection, fc1, fc2)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * (h + 2 * kv) + h * h + h * self.fc1_out + self.ffn * h

    def layer_params(self) -> int:
        """Elements of one layer's parameters: the GEMM weights, biases and two norms."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        norms = 2 * h * (2 if self.norm == "LayerNorm" else 1)
        biases = (h + 2 * kv) + h + self.fc1_out + h if self.bias else 0
        return self.fp8_layer_params() + norms + biases

    def other_params(self) -> int:
        """Elements outside the layers: embedding, final norm, LM head (unless tied)."""
        norm = self.hidden * (2 if self.norm == "LayerNorm" else 1)
        return self.vocab * self.hidden * (1 if self.tied else 2) + norm

    def parameters(self) -> int:
        return self.layers * self.layer_params() + self.other_params()


_LLAMA3 = dict(vocab=128256, activation="swiglu", norm="RMSNorm", bias=False)
LLAMA = {
    # Llama-3.2-1B: tied embeddings.
    "llama-1b": ModelShape(
        hidden=2048, heads=32, kv_heads=8, ffn=8192, layers=16, tied=True, **_LLAMA3
    ),  # fmt: skip
    "llama-8b": ModelShape(hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=32, **_LLAMA3),
    "llama-70b": ModelShape(hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80, **_LLAMA3),
}


def shape_from(cfg, vocab: int | None = None) -> ModelShape:
    """The shape of a graphfp8-train ModelConfig (graphfp8/training/model.py's PRESETS; read by
    attribute: reports sit below the training app), `vocab` replacing its vocabulary."""
    return ModelShape(hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads or cfg.heads,
                      ffn=cfg.ffn, layers=cfg.layers, vocab=vocab or cfg.vocab,
                      activation=cfg.activation, norm=cfg.norm, bias=cfg.bias,
                      tied=getattr(cfg, "tie_embeddings", False))  # fmt: skip


def shape_of(name: str) -> ModelShape:
    """The shape of Llama preset `name` (LLAMA)."""
    if name not in LLAMA:
        raise ValueError(f"no preset {name!r}; presets: {', '.join(sorted(LLAMA))}")
    return LLAMA[name]
