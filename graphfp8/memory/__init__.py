"""Memory accounting: what a model, its FP8 state, its graphs and its autograd graph hold."""

from graphfp8.memory.live import LiveBytes
from graphfp8.memory.report import CATEGORIES, MemoryReport, cuda_counters, memory_report
from graphfp8.memory.saved import NodeSaves, walk_saved

__all__ = [
    "CATEGORIES",
    "LiveBytes",
    "MemoryReport",
    "NodeSaves",
    "cuda_counters",
    "memory_report",
    "walk_saved",
]
