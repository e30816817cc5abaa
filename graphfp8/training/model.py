"""A small GPT built from graphfp8.TransformerLayers, and the model-size presets.

    tokens (B, S) int64 -> Embedding -> Blocks (the graphed part) -> LayerNorm -> head -> logits

The llama-* presets build Llama-style blocks: RMSNorm (the final norm too), grouped-query
attention, SwiGLU, no biases, RoPE.

Only `Blocks` holds FP8 layers and is what the training loop captures: the embedding, the final
norm, the vocabulary head and the loss stay eager (a handful of kernels per microbatch).

Initialisation is TransformerEngine's default (GEMM weights normal(0, 0.02), biases 0), also for
the embedding and the head. With torch.nn.Linear's uniform initialisation instead, bf16 and FP8
runs of the same seed and data ended up to 3-6% apart in validation loss on the 100m preset, in
either direction, and bf16 alone trained ~2% worse (notes/NUMERICS.md, H200 2026-12-01).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from graphfp8.fp8.autocast import fp8_autocast
from graphfp8.modules.transformer import TransformerLayer
from graphfp8.training.presets import PRESETS, ModelConfig

__all__ = ["GPT", "Blocks", "ModelConfig", "PRESETS", "count_parameters"]

INIT_STD = 0.02
# TransformerEngine's default init_method (and output_layer_init_method).
init_normal = partial(nn.init.normal_, mean=0.0, std=INIT_STD)


class Blocks(nn.Module):
    """The TransformerLayers, called in order: (B, S, H) -> (B, S, H). Each layer but the last
    hands its second residual add to the next one, whose first norm does it (TransformerLayer's
    defer_residual): one elementwise add and one gradient sum fewer per layer.

    bf16_layers: the indices of the layers that run in bf16 inside an FP8 region (Megatron's
    --first-last-layers-bf16), each inside fp8_autocast(enabled=False): eagerly and in every
    graph alike."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device,
                 bf16_layers: frozenset[int] = frozenset()):  # fmt: skip
        super().__init__()
        self.bf16_layers = frozenset(bf16_layers)
        self.graphed = None  # per-layer graphed calls (training/fsdp.py's LayerCall) or None
        self.layers = nn.ModuleList(
            TransformerLayer(
                cfg.hidden,
                cfg.heads,
                cfg.ffn,
                max_seq_len=cfg.seq_len,
                params_dtype=dtype,
                device=device,
                num_gqa_groups=cfg.kv_heads,
                activation=cfg.activation,
                normalization=cfg.norm,
                bias=cfg.bias,
                init_method=init_normal,
            )  # fmt: skip
            for _ in range(cfg.layers)
        )

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x: (B, S, H); segment_ids: optional (B, S) documents of packed rows (--pack). Each
        layer hands its second residual add to the next one's first norm."""
        kw = {} if segment_ids is None else {"segment_ids": segment_ids}  # graphed layers too
        residual = None
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1
            bf16 = (
                fp8_autocast(enabled=False) if i in self.bf16_layers else contextlib.nullcontext()
            )
            with bf16:
                if self.graphed is not None:  # tensor arguments only (fsdp.LayerCall)
                    extra = () if residual is None else (residual,)
                    out = self.graphed[i](x, *extra, is_first_microbatch=is_first_microbatch,
                                          **kw)  # fmt: skip
                else:
                    out = layer(x, is_first_microbatch=is_first_microbatch, residual=residual,
                                defer_residual=not last, **kw)  # fmt: skip
            x, residual = (out, None) if last else out
        return x


class GPT(nn.Module):
    """Decoder-only language model over bytes (or a token file's vocabulary).

    Args:
        cfg: the preset.
        dtype: parameter and activation dtype (bf16 for training).
        device: where the parameters live.
        bf16_layers: indices of the blocks kept in bf16 in FP8 runs (Blocks).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device=None,
                 bf16_layers: frozenset[int] = frozenset()):  # fmt: skip
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dtype, device=device)
        self.blocks = Blocks(cfg, dtype, device, bf16_layers)
        norm = nn.RMSNorm if cfg.norm == "RMSNorm" else nn.LayerNorm
        self.norm = norm(cfg.hidden, eps=1e-5, dtype=dtype, device=device)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dtype, device=device)
        nn.init.normal_(self.embed.weight, std=INIT_STD)
        if cfg.tie_embeddings:  # one (vocab, H) parameter, initialised once
            self.head.weight = self.embed.weight
        else:
            nn.init.normal_(self.head.weight, std=INIT_STD)

    def hidden(self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, S) int64 -> the blocks' output (B, S, H), eagerly (validation)."""
        return self.blocks(self.embed(tokens), segment_ids=segment_ids)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden: (B, S, H) output of the blocks; targets: (B, S) int64, -100 where no token is
        predicted (a packed document's first token). Mean cross entropy, float32."""
        logits = self.head(self.norm(hidden)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden: (B, S, H); targets: (B, S) int64. Cross entropy per token, (B, S) float32 (0
        where the target is -100)."""
        logits = self.head(self.norm(hidden)).float()
        losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                                 reduction="none")  # fmt: skip
        return losses.view(targets.shape)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                segment_ids: torch.Tensor | None = None,
                is_first_microbatch: bool | None = None) -> torch.Tensor:  # fmt: skip
        """tokens, targets: (B, S) int64; segment_ids: optional (B, S) documents (--pack; third
        so that the step graph's model(tokens, targets, segment_ids) passes it).
        Returns the mean cross entropy (float32)."""
        hidden = self.blocks(self.embed(tokens), is_first_microbatch=is_first_microbatch,
                             segment_ids=segment_ids)  # fmt: skip
        return self.loss(hidden, targets)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
