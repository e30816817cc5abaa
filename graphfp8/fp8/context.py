"""The FP8 context: what the innermost fp8_autocast region or capture says, as one frozen value.

    fp8_autocast(...)            pushes FP8Context(enabled, recipe, group, region)
    CaptureSession.recording()   pushes the capture's: its recipe and group, the weight-cache
                                 policy of its graphs and a fresh ArenaRecorder
    the step graph, per batch    pushes the capture's with that microbatch's weight-cache flag

Values are pushed on a small stack and never changed; `current()` is the innermost one (OFF
outside any). Modules read it in one place (graphfp8/modules/_context.py), which turns it into
the GEMM configs of a forward; nothing writes back into it. What a capture learns from its
modules - the arenas they use - is collected by the context's recorder and returned by the
recording that pushed it. When the arenas update is graphfp8/fp8/scale_schedule.py's business.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from graphfp8 import global_state
from graphfp8.fp8.recipe import Recipe
from graphfp8.fp8.weight_cache import EAGER, WeightCachePolicy

__all__ = ["ArenaRecorder", "FP8Context", "OFF", "current", "pushed"]


class ArenaRecorder:
    """Collects the FP8 arenas that modules use while a capture's context is pushed (warmup
    finds the arenas whose updates the graphs hold; a capture checks it found no new one), and
    the scale updates recorded meanwhile (graphfp8/fp8/scale_schedule.py)."""

    def __init__(self) -> None:
        self._arenas: dict[int, object] = {}
        self.updates: list[tuple[str, tuple]] = []

    def record(self, *arenas) -> None:
        for arena in arenas:
            self._arenas[id(arena)] = arena

    @property
    def arenas(self) -> dict[int, object]:
        """{id(arena): arena} of the arenas used, in first-use order."""
        return dict(self._arenas)


@dataclass(frozen=True)
class FP8Context:
    """One fp8_autocast region's or capture's FP8 settings.

    Attributes:
        enabled: graphfp8 modules run in FP8.
        recipe: the recipe they run under (None: a capture without FP8).
        group: the torch.distributed group whose ranks MAX-reduce amaxes before every update.
        region: the outermost enabled fp8_autocast region this context belongs to (eager
            forward updates run once per region: scale_schedule.py); 0 outside any.
        weight_cache: who decides whether a forward casts its weights (weight_cache.py): the
            module's is_first_microbatch on the host (EAGER), or a graph's device flag.
        recorder: inside a capture (warmup included), what collects the arenas used; None in
            eager mode, where nothing is recorded and the updates run as the schedule says.
        recompute: inside an activation-checkpointed region, its fp8/recompute.py Region: the
            forward records the slots it uses there, the recompute replays them; else None.
        init_group: the fp8/scaling.py InitGroup modules that first run here take their slots
            from (None outside any region: scaling's group of slots taken outside).
    """

    enabled: bool = False
    recipe: Recipe | None = None
    group: object = None
    region: int = 0
    weight_cache: WeightCachePolicy = EAGER
    recorder: ArenaRecorder | None = field(default=None, compare=False)
    recompute: object = field(default=None, compare=False)
    init_group: object = field(default=None, compare=False)

    @property
    def capturing(self) -> bool:
        """Inside a capture's warmup or capture: updates are recorded, never implicit."""
        return self.recorder is not None


OFF = FP8Context()
_STACK: list[FP8Context] = []


def current() -> FP8Context:
    """The innermost pushed context, OFF outside any."""
    return _STACK[-1] if _STACK else OFF


@contextlib.contextmanager
def pushed(ctx: FP8Context):
    """Makes `ctx` the current context for the block."""
    _STACK.append(ctx)
    try:
        yield ctx
    finally:
        # Innermost first; a generator left open elsewhere may pop out of order.
        for i in range(len(_STACK) - 1, -1, -1):
            if _STACK[i] is ctx:
                del _STACK[i]
                break


global_state.register("the FP8 context stack (fp8/context.py)", _STACK.clear,
                      lambda: not _STACK, layer=global_state.FP8)  # fmt: skip
