"""The context managers the capture phases run under: FP8 state and RNG restored, garbage
collection paused, the side stream that warms up and captures."""

from __future__ import annotations

import contextlib
import gc

import torch

from graphfp8.fp8 import scaling
from graphfp8.graphs.backends import capture_stream

__all__ = ["fp8_and_rng_preserved", "gc_paused", "side_stream"]


@contextlib.contextmanager
def fp8_and_rng_preserved(recipe, device):
    """Snapshots the recipe's arenas and the RNG, and puts them back when the block ends (also
    when it raises): what warmup and the CPU tape's capture run must leave no trace. Arenas
    created inside the block go back to fresh slots."""
    arenas = scaling.live_arenas(recipe) if recipe is not None else []
    snaps = [(a, a.snapshot()) for a in arenas]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seen = {id(a) for a in arenas}
        for arena, snap in snaps:
            arena.restore_(snap)
        for arena in scaling.live_arenas(recipe) if recipe is not None else []:
            if id(arena) not in seen:  # created during the phase: back to fresh slots
                arena.reset_()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


@contextlib.contextmanager
def gc_paused(device):
    """No garbage collection inside the block: a collected graph of an earlier capture would
    free its memory pool, which a CUDA capture in progress does not allow."""
    if device.type == "cuda":  # what a collection would free must go before the capture starts
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def side_stream(device):
    """Runs the block on the capture stream of a CUDA device (nothing to do on the CPU)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
