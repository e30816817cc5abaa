"""Memory accounting: what a model, its FP8 state, its graphs and its autograd graph hold, and the
bytes per parameter of one rank's training state (sharded or not)."""

from graphfp8.memory.allocated import AllocatedBytes
from graphfp8.memory.live import LiveBytes
from graphfp8.memory.report import CATEGORIES, MemoryReport, cuda_counters, memory_report
from graphfp8.memory.saved import NodeSaves, walk_saved
from graphfp8.memory.state import STATE_CATEGORIES, TrainingState, sharded_at, training_state

__all__ = [
    "AllocatedBytes",
    "CATEGORIES",
    "LiveBytes",
    "MemoryReport",
    "NodeSaves",
    "STATE_CATEGORIES",
    "TrainingState",
    "cuda_counters",
    "memory_report",
    "sharded_at",
    "training_state",
    "walk_saved",
]
