"""graphfp8's form of a Hugging Face decoder-only language model: the HF embedding, final norm
and LM head modules themselves around graphfp8 TransformerLayers.

    input_ids (B, S) -> embed (+ learned positions, GPT-2) -> TransformerLayers -> norm -> lm_head

Each TransformerLayer can be graphed on its own (make_graphed_callables on the tuple of
`layers`: the loop below then calls the graphs), or the whole model with make_graphed_step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalLM", "causal_lm_loss"]

IGNORE = -100  # Hugging Face's and F.cross_entropy's ignored target


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32.

    Args:
        logits: (B, S, V), any float dtype.
        targets: (B, S) int64, the token that follows each input token (-100: not counted).
            Hugging Face's `labels` are the inputs themselves: targets = labels[:, 1:] against
            logits[:, :-1].
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


class CausalLM(nn.Module):
    """A converted model (graphfp8.from_hf builds it; graphfp8.to_hf writes it back).

    Attributes:
        arch: "llama" (Llama, Mistral, Qwen2) or "gpt2".
        config: the Hugging Face config it was converted from.
        embed, norm, lm_head: the HF model's own modules (shared, not copied; tied embeddings
            stay tied).
        layers: nn.ModuleList of graphfp8.TransformerLayer.
        pos_embed: GPT-2's learned position embedding (the HF module), else None.
        sliding_window: attention window (Mistral); longer inputs raise.
    """

    def __init__(self, arch: str, config, embed: nn.Module, layers: list[nn.Module],
                 norm: nn.Module, lm_head: nn.Module, pos_embed: nn.Module | None = None,
                 sliding_window: int | None = None):  # fmt: skip
        super().__init__()
        self.arch, self.config, self.sliding_window = arch, config, sliding_window
        self.embed, self.layers, self.norm, self.lm_head = (
            embed,
            nn.ModuleList(layers),
            norm,
            lm_head,
        )
        self.pos_embed = pos_embed

    def forward(self, input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None,
                is_first_microbatch: bool | None = None) -> torch.Tensor:  # fmt: skip
        """input_ids: (B, S) int64; segment_ids: optional (B, S) packed documents or padding
        (graphfp8.ops.segments). Returns logits (B, S, vocab) in the parameters' dtype."""
        seq = input_ids.shape[1]
        if self.sliding_window is not None and seq > self.sliding_window:
            raise ValueError(
                f"graphfp8.hf: {seq} tokens exceed the model's attention window "
                f"{self.sliding_window} (sliding-window attention is not converted)"
            )
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(seq, device=input_ids.device))
        # Only when given: a layer graphed without segment_ids takes no such argument.
        kw = {} if segment_ids is None else {"segment_ids": segment_ids}
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch, **kw)
        return self.lm_head(self.norm(x))

    def extra_repr(self) -> str:
        return f"arch={self.arch}, model_type={self.config.model_type}"
