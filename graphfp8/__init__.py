"""graphfp8: CUDA-graph-centric FP8 training for PyTorch."""

from graphfp8 import ops
from graphfp8.recipe import DelayedScaling, Format

__all__ = ["DelayedScaling", "Format", "ops"]
