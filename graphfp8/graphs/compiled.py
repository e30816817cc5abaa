"""torch.compile and the capturer (docs/architecture.md, "torch.compile").

Supported order: capture first, compile around. A graphed callable replays its graphs as one
opaque call that dynamo never traces, so `torch.compile` of a model that calls graphed blocks
compiles the code around them. The other order is refused (graphs/capture_checks.py): a graph
holds the kernels that ran while it was captured, so capturing a compiled callable would either
record inductor's kernels behind the capturer's back (the CPU replay tape sees only dispatcher
ops) or silently set the compile aside. Compiled code that hides inside a plain function is run
eagerly while capturing, so whatever a graph records is what eager mode computes.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["compile_set_aside", "compiled_part", "opaque_to_dynamo"]


def compiled_part(func) -> str | None:
    """What about `func` is torch.compile'd, or None (capture_checks.check_capturable refuses
    it)."""
    if not _dynamo_loaded():  # nothing can be compiled
        return None
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(func, OptimizedModule):
        return "a torch.compile'd module (torch.compile(module))"
    if hasattr(func, "_torchdynamo_orig_callable"):
        return "a torch.compile'd function"
    if isinstance(func, nn.Module):
        for name, module in func.named_modules():
            where = f"its submodule {name!r}" if name else "the module itself"
            if isinstance(module, OptimizedModule):
                return f"a module with a torch.compile'd part ({where})"
            if getattr(module, "_compiled_call_impl", None) is not None:
                return f"a module with a part compiled by Module.compile() ({where})"
    return None


@contextlib.contextmanager
def compile_set_aside():
    """Warmup and capture run torch.compile'd code reached through plain functions eagerly, so
    the graphs record the kernels eager mode runs (the CPU tape cannot see inductor's)."""
    if not _dynamo_loaded():  # nothing can be compiled
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def _dynamo_loaded() -> bool:
    """Whether torch._dynamo was imported (torch.compile imports it; importing it here would
    take as long as importing torch)."""
    return "torch._dynamo" in sys.modules


def opaque_to_dynamo(replay: Callable) -> Callable:
    """`replay` (a graphed callable's call) as one call that torch.compile never traces; called
    directly when not tracing (torch.compiler.disable costs ~1 us a call)."""
    opaque = torch.compiler.disable(
        replay,
        recursive=True,
        reason="graphfp8: a graphed callable (microbatch, step) replays captured graphs, which "
        "torch.compile runs "
        "as one opaque call between the graphs it compiles around it, so fullgraph=True cannot "
        "hold it. Compile without fullgraph=True (the code before and after the graphed "
        "callable is still compiled), or compile only the code between graphed callables",
    )

    @functools.wraps(replay)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return opaque(*args, **kwargs)
        return replay(*args, **kwargs)

    return call
