"""graphfp8.te: a TransformerEngine (PyTorch) drop-in over graphfp8.

    import graphfp8.te as te                     # for: import transformer_engine.pytorch as te
    from graphfp8.te import recipe               # for: from transformer_engine.common import recipe
    from graphfp8.te.recipe import Format, DelayedScaling   # ... common.recipe import ...

TE's names, signatures, defaults and module trees for what graphfp8 has: Linear,
LayerNormLinear, LayerNormMLP, LayerNorm, RMSNorm, DotProductAttention, TransformerLayer,
fp8_autocast / autocast, fp8_model_init / quantized_model_init, make_graphed_callables,
get_cpu_offload_context (disabled only) and the recipe module (DelayedScaling,
Float8CurrentScaling, Format). A TE argument graphfp8 does not implement raises
NotImplementedError naming it unless it has TE's default value; a TE name graphfp8 does not
have raises AttributeError saying so. What differs from TE: docs/te.md.
"""

from __future__ import annotations

from graphfp8.te import recipe
from graphfp8.te.attention import DotProductAttention
from graphfp8.te.modules import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from graphfp8.te.quantization import (
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_cpu_offload_context,
    make_graphed_callables,
    quantized_model_init,
)
from graphfp8.te.transformer import TransformerLayer

__all__ = [
    "DotProductAttention",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "RMSNorm",
    "TransformerLayer",
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "get_cpu_offload_context",
    "make_graphed_callables",
    "quantized_model_init",
    "recipe",
]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"graphfp8.te has no {name!r}: graphfp8 implements TransformerEngine's {', '.join(__all__)}"
        " (docs/te.md)"
    )
