"""The FP8 arenas: every slot's amax history and scale, one contiguous block per direction.

An Arena holds all slots of one direction (forward or backward) for one recipe on one device:

    amax_history  (L, S) float32   row 0 is where this step's casts write their amax
    scale         (S,)   float32
    scaled_max    (S,)   float32   fp8_max * 2**-margin, per slot

One fused kernel updates all S slots in one launch. Modules own `SlotBlock`s (a start and a
count in an arena) and fetch their per-slot views through them, so an arena can grow while it is
not captured: growing reallocates the tensors and bumps `version`, and every SlotBlock refetches.
Once a graph has captured an arena it is frozen: modules created later start a new arena (the
captured graph keeps raw pointers to the old tensors, which therefore must never move).

Which modules share an arena: modules get their slots when they first run in FP8 (or load FP8
state), from an *init group* (InitGroup), a value that the FP8 context carries: a new one for
every outermost fp8_autocast region and every capture. So the layers of one model, initialised
in its first region, share one arena per direction, while two models initialised in different
regions (a model and its copy resumed from a checkpoint, an eager model and a graphed one) never
share: one model's scale updates cannot touch the other's state. When an arena updates is
graphfp8/fp8/scale_schedule.py's business.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphfp8 import global_state, ops
from graphfp8.fp8.arena_check import check_arena_consistency, needs_reduction
from graphfp8.fp8.recipe import Recipe, fp8_max, is_current_scaling

__all__ = [
    "Arena",
    "REGISTRY",
    "SlotBlock",
    "allocate",
    "freeze",
    "InitGroup",
    "live_arenas",
]

FORWARD, BACKWARD = "forward", "backward"


class Arena:
    """All FP8 slots of one direction for one recipe on one device."""

    _serials = itertools.count(1)  # creation order, never reused

    def __init__(self, recipe: Recipe, device: torch.device, direction: str):
        self.serial = next(Arena._serials)
        self.recipe = recipe
        self.device = torch.device(device)
        self.direction = direction
        fmt = recipe.fp8_format
        self.fp8_dtype = fmt.fwd_dtype if direction == FORWARD else fmt.bwd_dtype
        length = recipe.amax_history_len
        self.amax_history = torch.zeros(length, 0, dtype=torch.float32, device=self.device)
        self.scale = torch.ones(0, dtype=torch.float32, device=self.device)
        self.scaled_max = torch.ones(0, dtype=torch.float32, device=self.device)
        # Current scaling: the casts' own amaxes go here (nobody reads it); the slot's H[0] holds
        # only the amax pass's result, consumed by the per-cast update (graphfp8/fp8/current.py).
        self.amax_sink = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.version = 0
        self.frozen = False
        self.updated_in = -1  # the fp8_autocast region that last updated it (scale_schedule.py)
        # {group: version} of the groups whose ranks were found to hold a matching arena
        # (arena_check); weak, so that a destroyed group is not kept alive here.
        self.checked_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def num_slots(self) -> int:
        return self.scale.numel()

    def grow(self, count: int) -> int:
        """Appends `count` fresh slots (history 0, scale 1); returns the first new index."""
        if self.frozen:
            raise RuntimeError(
                f"graphfp8: the {self.direction} FP8 arena is captured in a graph and cannot "
                "grow; modules created after a capture get a new arena"
            )
        start = self.num_slots
        length = self.amax_history.shape[0]
        dev = self.device
        self.amax_history = torch.cat(
            [self.amax_history, torch.zeros(length, count, device=dev)], dim=1
        ).contiguous()
        self.scale = torch.cat([self.scale, torch.ones(count, device=dev)])
        limit = fp8_max(self.fp8_dtype) * 2.0**-self.recipe.margin
        self.scaled_max = torch.cat([self.scaled_max, torch.full((count,), limit, device=dev)])
        self.version += 1
        return start

    def update_(self, group=None) -> None:
        """One delayed-scaling step for every slot: optional MAX all-reduce of row 0 over
        `group` (when the recipe says reduce_amax and the group has several ranks), then the
        fused kernel. Reducing row 0 in place equals docs/fp8.md's `a = R if R != 0 else H[0]`:
        R is the max over ranks of non-negative amaxes, so R == 0 implies H[0] == 0. Before the
        first reduction of this arena over `group`, the ranks check that their arenas match
        (arena_check.check_arena_consistency), so a mismatch raises instead of hanging. Under
        Float8CurrentScaling it does nothing."""
        if self.num_slots == 0 or is_current_scaling(self.recipe):
            return  # current scaling updates each slot at its cast
        if needs_reduction(group):
            check_arena_consistency(self, group)
            if self.recipe.reduce_amax:
                dist.all_reduce(self.amax_history[0], op=dist.ReduceOp.MAX, group=group)
        ops.scale_update_(
            self.amax_history,
            self.scale,
            self.scaled_max,
            self.recipe.amax_compute_algo == "most_recent",
        )

    def snapshot(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        return self.num_slots, self.amax_history.clone(), self.scale.clone()

    def reset_(self) -> None:
        """Every slot back to its initial state (history 0, scale 1)."""
        self.amax_history.zero_()
        self.scale.fill_(1.0)

    def restore_(self, snap: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        """Puts back a snapshot; slots added since then return to their initial state."""
        count, history, scale = snap
        self.amax_history[:, :count].copy_(history)
        self.amax_history[:, count:].zero_()
        self.scale[:count].copy_(scale)
        self.scale[count:].fill_(1.0)


@dataclass
class SlotBlock:
    """`count` consecutive slots of one arena, with cached per-slot views."""

    arena: Arena
    start: int
    count: int

    def __post_init__(self) -> None:
        self._version = -1
        self._scales: list[torch.Tensor] = []
        self._amaxes: list[torch.Tensor] = []

    def _refresh(self) -> None:
        a, s0, n = self.arena, self.start, self.count
        self._scales = [a.scale[s : s + 1] for s in range(s0, s0 + n)]
        self._amaxes = [a.amax_history[0, s : s + 1] for s in range(s0, s0 + n)]
        self._version = a.version

    def scale(self, i: int) -> torch.Tensor:
        """(1,) float32 view of slot i's scale."""
        if self._version != self.arena.version:
            self._refresh()
        return self._scales[i]

    def amax(self, i: int) -> torch.Tensor:
        """(1,) float32 view of slot i's H[0], where casts fold their amax."""
        if self._version != self.arena.version:
            self._refresh()
        return self._amaxes[i]

    def history(self) -> torch.Tensor:
        """(L, count) view of these slots' amax histories."""
        return self.arena.amax_history[:, self.start : self.start + self.count]

    def scales(self) -> torch.Tensor:
        """(count,) view of these slots' scales."""
        return self.arena.scale[self.start : self.start + self.count]


class InitGroup:
    """Modules that take their slots through one InitGroup share one arena per (recipe, device,
    direction): {key: arena}. A value, never a process-wide toggle: each outermost fp8_autocast
    region carries a new one in its context (fp8/autocast.py), a capture one per chunk of modules
    (graphs/fp8_init.py), a model carrying its recipe its own (modules/carry.py), a deep copy its
    own (modules/base.py)."""

    def __init__(self) -> None:
        self.open: dict[tuple, Arena] = {}

    def allocate(self, recipe: Recipe, device, direction: str, count: int) -> SlotBlock:
        """Reserves `count` slots in this group's arena for (recipe, device, direction)."""
        key = (recipe, torch.device(device), direction)
        arena = self.open.get(key)
        if arena is None or arena.frozen:
            arena = Arena(recipe, torch.device(device), direction)
            REGISTRY.arenas.add(arena)
            self.open[key] = arena
        return SlotBlock(arena, arena.grow(count), count)


class ReplaySlots:
    """A SlotBlock as the casts of a recomputed forward see it (fp8/recompute.py): the scales
    saved after the original forward, amaxes folded into a scratch, no cast observed. So
    a recompute casts exactly as the forward did and records nothing (docs/fp8.md,
    "Activation recompute")."""

    def __init__(self, block: SlotBlock, saved_scales: torch.Tensor):
        self.block, self.arena = block, block.arena
        self.start, self.count = block.start, block.count
        self.saved_scales = saved_scales
        self._views = [saved_scales[i : i + 1] for i in range(block.count)]
        # one scratch amax per slot, never read: a kernel that writes several (FP8 attention)
        # gets distinct outputs, as from the arena
        scratch = torch.zeros(block.count, dtype=torch.float32, device=saved_scales.device)
        self._amaxes = [scratch[i : i + 1] for i in range(block.count)]

    def scale(self, i: int) -> torch.Tensor:
        return self._views[i]

    def amax(self, i: int) -> torch.Tensor:
        return self._amaxes[i]

    def scales(self) -> torch.Tensor:
        return self.saved_scales

    def history(self) -> torch.Tensor:
        return self.block.history()


class ArenaRegistry:
    """Every live arena (weakly), and the init group of slots taken outside any fp8_autocast
    region or capture (a checkpoint loaded into a fresh module)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets every arena (modules keep theirs) and the group of slots taken outside."""
        self.arenas: weakref.WeakSet[Arena] = weakref.WeakSet()
        self.outside = InitGroup()

    def is_fresh(self) -> bool:
        return not self.arenas and not self.outside.open


REGISTRY = ArenaRegistry()
global_state.register("FP8 arena registry (fp8/scaling.py REGISTRY)", REGISTRY.reset,
                      REGISTRY.is_fresh, layer=global_state.FP8)  # fmt: skip
global_state.register_kept(
    "arena serial numbers (Arena._serials)",
    "arenas are ordered by creation (updates, checks across ranks): a reused serial would tie",
)


def freeze(arenas, frozen: bool = True) -> None:
    """Marks `arenas` as captured in a graph (frozen=True: they never grow or move again; modules
    created later get new arenas) or, undoing a failed capture, as free again."""
    for arena in arenas:
        arena.frozen = frozen


def allocate(recipe: Recipe, device, direction: str, count: int,
             group: InitGroup | None = None) -> SlotBlock:  # fmt: skip
    """Reserves `count` slots for (recipe, device, direction) in `group`'s arena (None: the group
    of slots taken outside any region)."""
    return (group or REGISTRY.outside).allocate(recipe, device, direction, count)


def live_arenas(recipe: Recipe) -> list[Arena]:
    """Live arenas of one recipe, both directions, in creation order."""
    arenas = (a for a in list(REGISTRY.arenas) if a.recipe == recipe)
    return sorted(arenas, key=lambda a: a.serial)
