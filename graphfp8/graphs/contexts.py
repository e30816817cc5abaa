"""The context managers the capture phases run under: FP8 state and RNG restored, garbage
collection paused, torch.autocast's cast cache off, the side stream that warms up and captures,
and the record of what a captured forward saves for its backward."""

from __future__ import annotations

import contextlib
import gc

import torch

from graphfp8.fp8 import scaling
from graphfp8.graphs.backends import capture_stream

__all__ = ["autocast_cache_off", "fp8_and_rng_preserved", "gc_paused", "saved_storages",
           "side_stream"]  # fmt: skip


@contextlib.contextmanager
def fp8_and_rng_preserved(recipes, device):
    """Snapshots the arenas of the recipes (a list) and the RNG, and puts them back when the
    block ends (also when it raises): what warmup and the CPU tape's capture run must leave no
    trace. Arenas created inside the block go back to fresh slots."""
    arenas = _live(recipes)
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
        for arena in _live(recipes):
            if id(arena) not in seen:  # created during the phase: back to fresh slots
                arena.reset_()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def _live(recipes) -> list:
    """The live arenas of the recipes, each once, in creation order."""
    arenas = {id(a): a for r in recipes for a in scaling.live_arenas(r)}
    return sorted(arenas.values(), key=lambda a: a.serial)


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
def autocast_cache_off():
    """torch.autocast's cache of parameter casts off inside the block. Under torch.autocast a
    parameter's low-precision cast is cached for the rest of the region: a capture inside that
    region would hold the cast that warmup (or an earlier eager call) made, not a cast of its
    own, and keep replaying that stale copy after the optimizer changed the parameter. Without
    the cache every capture records its casts, which give the cached casts' bits."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


@contextlib.contextmanager
def saved_storages():
    """Yields the set of the storages (data pointers) of every plain tensor that autograd saves
    for backward inside the block: the static buffers among them are read by the captured
    backward, so a write into them between a replay's forward and its backward changes the
    gradients (eager autograd refuses such a backward; graphs/runner.py does the same)."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and t.numel():
            seen.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


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
