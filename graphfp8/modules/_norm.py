"""LayerNorm / RMSNorm parameters and forward shared by the LayerNorm* modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def make_norm_params(module: nn.Module, size: int, normalization: str, dtype, device) -> None:
    """Registers TE-named `layer_norm_weight` (and `layer_norm_bias` for LayerNorm)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"{type(module).__name__}: normalization must be one of {NORMALIZATIONS}, "
            f"got {normalization!r}"
        )
    module.layer_norm_weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
    if normalization == "LayerNorm":
        module.layer_norm_bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
    else:
        module.register_parameter("layer_norm_bias", None)


def apply_norm(module: nn.Module, x: torch.Tensor, normalization: str, eps: float) -> torch.Tensor:
    """x: (..., size) -> normalized (..., size), same dtype."""
    shape = (x.shape[-1],)
    if normalization == "LayerNorm":
        return F.layer_norm(x, shape, module.layer_norm_weight, module.layer_norm_bias, eps)
    return F.rms_norm(x, shape, module.layer_norm_weight, eps)
