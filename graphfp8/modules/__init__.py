"""graphfp8 layers: FP8 under fp8_autocast, ordinary layers outside it."""

from graphfp8.modules.attention import DotProductAttention
from graphfp8.modules.base import FP8Module, cache_weight_transposes
from graphfp8.modules.convert import convert
from graphfp8.modules.layernorm_linear import LayerNormLinear
from graphfp8.modules.layernorm_mlp import LayerNormMLP
from graphfp8.modules.linear import Linear
from graphfp8.modules.transformer import TransformerLayer

__all__ = [
    "DotProductAttention",
    "FP8Module",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "TransformerLayer",
    "cache_weight_transposes",
    "convert",
]
