"""The graph capturer: CUDA graphs on the GPU, the replay tape on the CPU."""

from graphfp8.graphs.callables import make_graphed_callables
from graphfp8.graphs.fsdp_layers import init_fsdp2
from graphfp8.graphs.microbatch import GraphedMicrobatch, make_graphed_microbatch
from graphfp8.graphs.step import GraphedStep, make_graphed_step
from graphfp8.graphs.tape import CaptureError, RecordingMode, ReplayTape

__all__ = [
    "CaptureError",
    "GraphedMicrobatch",
    "GraphedStep",
    "RecordingMode",
    "ReplayTape",
    "init_fsdp2",
    "make_graphed_callables",
    "make_graphed_microbatch",
    "make_graphed_step",
]
