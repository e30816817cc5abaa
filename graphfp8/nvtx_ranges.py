"""NVTX ranges around the runtime's phases (the profile runner is graphfp8.training.step_profile).

Ranges (domain "graphfp8"): warmup, capture, replay-forward, replay-backward, replay-step,
replay-microbatch (graphs/), and forward, backward, optimizer, step (the training loop). They
are emitted only while profiling (the runner turns them on; GRAPHFP8_NVTX=1 does too), so an
ordinary run pays nothing for them.
Each range is an NVTX range (for nsys) and a torch.profiler record_function (for the fallback).

    python -m graphfp8.training.step_profile [--preset 100m] [--precision fp8] [--steps 3]

runs a few graphed training steps under `nsys profile -t cuda,nvtx --cuda-graph-trace=node`
when nsys is on PATH, else under torch.profiler (Chrome trace), and writes a summary (kernels
per microbatch, GPU busy fraction, host time per microbatch, top kernels) into profiles/.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["nvtx_range", "enable_ranges"]

from graphfp8 import global_state


def _from_environment() -> bool:
    return os.environ.get("GRAPHFP8_NVTX", "") == "1"


_ENABLED = _from_environment()


def enable_ranges(enabled: bool = True) -> None:
    """Turns the phase ranges on or off (they are off unless profiling)."""
    global _ENABLED
    _ENABLED = enabled


global_state.register(
    "NVTX ranges switch (nvtx_ranges.py)", lambda: enable_ranges(_from_environment()),
    lambda: _ENABLED == _from_environment(), layer=global_state.BASE,
)  # fmt: skip


# What nvtx_range returns while ranges are off: one shared do-nothing context (a generator-based
# context manager costs ~1.5 us per use, on every replay).
_OFF = contextlib.nullcontext()


def nvtx_range(name: str):
    """A named phase: an NVTX range and a torch.profiler range, while ranges are enabled; a
    shared null context otherwise."""
    return _ranges(name) if _ENABLED else _OFF


@contextlib.contextmanager
def _ranges(name: str):
    import torch

    try:
        import nvtx
    except ImportError:  # the ranges still reach torch.profiler
        nvtx = None
    with contextlib.ExitStack() as stack:
        if nvtx is not None:
            stack.enter_context(nvtx.annotate(name, domain="graphfp8"))
        stack.enter_context(torch.profiler.record_function(f"graphfp8::{name}"))
        yield
