"""The graph capturer: CUDA graphs on the GPU, the replay tape on the CPU."""

from graphfp8.graphs.capture import make_graphed_callables
from graphfp8.graphs.tape import CaptureError, RecordingMode, ReplayTape

__all__ = ["CaptureError", "RecordingMode", "ReplayTape", "make_graphed_callables"]
