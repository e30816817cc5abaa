"""Reproducible runs on request (graphfp8-train --deterministic): the same bits run to run, on
the GPU too, eager and graphed.

What decides it on a GPU: torch.use_deterministic_algorithms(True) - torch's SDPA then leaves out
cuDNN's attention (non-deterministic backward) and runs flash attention's deterministic backward
(graphfp8's FP8 attention refuses to train under it on the GPU: graphfp8.ops.cudnn_determinism
says why) - and cuBLAS's
workspace configuration (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts). graphfp8's own
kernels sum without atomics (amax is an order-free atomic max), so they need nothing. Uninitialized
memory is not filled (torch's default under deterministic algorithms costs a kernel per empty
tensor, and graphfp8 reads none).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["deterministic"]

CUBLAS_CONFIG = ":4096:8"


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Runs the block with deterministic algorithms (strict: an op without a deterministic
    implementation raises) when `enabled`; restores the previous settings after. Enter it before
    the first cuBLAS call of the process (cuBLAS reads its workspace setting once)."""
    if not enabled:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory,
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))  # fmt: skip
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_CONFIG)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]
        if saved[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
