"""graphfp8: CUDA-graph-centric FP8 training for PyTorch."""

from graphfp8 import ops
from graphfp8.autocast import fp8_autocast
from graphfp8.graphs import CaptureError, make_graphed_callables
from graphfp8.modules import (
    FP8Module,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    TransformerLayer,
    convert,
)
from graphfp8.recipe import DelayedScaling, Format
from graphfp8.tensor import Float8Tensor

__all__ = [
    "CaptureError",
    "DelayedScaling",
    "FP8Module",
    "Float8Tensor",
    "Format",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "TransformerLayer",
    "convert",
    "fp8_autocast",
    "make_graphed_callables",
    "ops",
]
