"""torch.compile and the FP8 layers: under fp8_autocast, dynamo graph-breaks around each layer.

The FP8 forward keeps its bookkeeping in Python objects that change on every microbatch (the
weight-cache flag, the region counter that places the forward scale update, arenas that grow,
weight workspaces with their transpose caches, the end-of-backward update callback). Traced by
dynamo, each would be frozen into a graph, guarded on (a recompile every microbatch) or rebuilt
from graph outputs: that last one is how a compiled call once left a module with an FP8 weight
workspace without its transpose buffer, in compiled and eager use alike (docs/architecture.md,
"torch.compile"). So while tracing with FP8 on, the layer's whole forward runs as an opaque eager
call: dynamo compiles the code around it, the layer computes exactly what eager mode computes,
and tracing never executes or records its FP8 bookkeeping. Outside fp8_autocast the layer is an
ordinary torch layer and is traced and compiled like one (dynamo guards on the FP8 switch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from graphfp8.modules._context import fp8_enabled

__all__ = ["eager_under_fp8", "prepare_for_compile"]


def eager_under_fp8(forward: Callable, layer: str) -> Callable:
    """Wraps an FP8 layer's forward so that torch.compile runs it eagerly under fp8_autocast.

    Args:
        forward: the layer class's forward(self, ...).
        layer: the class's name, for the error that fullgraph=True raises.

    Returns:
        forward(self, ...) that calls `forward` directly when not tracing or when FP8 is off,
        and through torch.compiler.disable when tracing under FP8 (which costs ~1 us a call,
        kept out of eager mode). The disabled twin is made by prepare_for_compile.
    """
    reason = (
        f"graphfp8.{layer} runs its FP8 forward eagerly under fp8_autocast (its per-microbatch "
        "FP8 state must not be traced): torch.compile graph-breaks around it, so fullgraph=True "
        "cannot hold it. Compile the code around graphfp8 layers, or capture the layers with "
        "graphfp8.make_graphed_callables"
    )
    opaque: list[Callable] = []

    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        if fp8_enabled() and torch.compiler.is_compiling():
            if not opaque:  # a layer made without __init__ (unpickled): a plain graph break
                return torch.compiler.disable(forward, reason=reason)(self, *args, **kwargs)
            return opaque[0](self, *args, **kwargs)
        return forward(self, *args, **kwargs)

    def prepare() -> None:
        if not opaque:
            opaque.append(torch.compiler.disable(forward, recursive=True, reason=reason))

    wrapped._graphfp8_prepare = prepare
    return wrapped


def prepare_for_compile(cls: type) -> None:
    """Makes the torch.compiler.disable'd twins of cls's wrapped forwards (its bases' too).

    Called when a layer is built, not at import: torch.compiler.disable imports torch._dynamo,
    which takes about as long as importing torch.
    """
    for klass in cls.__mro__:
        prepare = getattr(klass.__dict__.get("forward"), "_graphfp8_prepare", None)
        if prepare is not None:
            prepare()
