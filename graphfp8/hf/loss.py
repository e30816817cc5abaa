"""The next-token loss of a converted model's logits (no transformers import)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE", "causal_lm_loss"]

IGNORE = -100  # Hugging Face's and F.cross_entropy's ignored target


def causal_lm_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32.

    Args:
        logits: (B, S, V), any float dtype, or a model output holding them (`.logits`).
        targets: (B, S) int64, the token that follows each input token (-100: not counted).
            Hugging Face's `labels` are the inputs themselves: targets = labels[:, 1:] against
            logits[:, :-1] (the model's `labels=` argument does that shift itself).
    """
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
