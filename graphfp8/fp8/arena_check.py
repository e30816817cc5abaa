"""Before ranks MAX-reduce an FP8 arena over a process group, they check that their arenas match.

A mismatch (another slot count, history length or recipe on one rank) would make the amax
all-reduce hang or mix unrelated slots; instead every rank raises a RuntimeError naming each
difference. The check is itself a collective (an all_gather of a few integers), run once per
(arena, group, arena size): eagerly at the first update, and by make_graphed_callables before
warmup, never inside a capture.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from graphfp8.fp8.recipe import Format

__all__ = ["check_arena_consistency", "check_arenas", "check_recipe_agrees", "needs_reduction"]

# {group: repr of the recipe its ranks last agreed on}: fp8_autocast checks a new one once.
AGREED_RECIPES: dict = {}

# What ranks must agree on before they all-reduce an arena, in the exchanged order.
_FIELDS = ("direction", "slots", "history_len", "margin", "format", "amax_compute_algo",
           "reduce_amax")  # fmt: skip
_DIRECTIONS = ("forward", "backward")
_FORMATS = tuple(Format)
_ALGOS = ("max", "most_recent")


def needs_reduction(group) -> bool:
    """True when `group` is given and has more than one rank."""
    return group is not None and dist.get_world_size(group) > 1


# `arena` below is a graphfp8.fp8.scaling.Arena, not imported: scaling imports this module.


def _layout(arena) -> list[int]:
    """The arena's direction, size and recipe as integers, in _FIELDS order."""
    recipe = arena.recipe
    return [
        _DIRECTIONS.index(arena.direction),
        arena.num_slots,
        arena.amax_history.shape[0],
        recipe.margin,
        _FORMATS.index(recipe.fp8_format),
        _ALGOS.index(recipe.amax_compute_algo),
        int(recipe.reduce_amax),
    ]


def _field_text(name: str, value: int) -> str:
    if name == "direction":
        return _DIRECTIONS[value]
    if name == "format":
        return _FORMATS[value].name
    if name == "amax_compute_algo":
        return repr(_ALGOS[value])
    if name == "reduce_amax":
        return str(bool(value))
    return str(value)


def _mismatches(rows: list[list[int]], direction: str) -> list[str]:
    """One line per rank and field that differs from group rank 0."""
    lines = []
    for rank, row in enumerate(rows[1:], start=1):
        for name, mine, theirs in zip(_FIELDS, row, rows[0], strict=True):
            if mine == theirs:
                continue
            if name == "slots":
                lines.append(f"rank {rank} has {mine} {direction} FP8 slots, rank 0 has {theirs}")
            else:
                lines.append(
                    f"rank {rank} has {name}={_field_text(name, mine)} in its {direction} arena, "
                    f"rank 0 has {name}={_field_text(name, theirs)}"
                )
    return lines


def check_arena_consistency(arena, group) -> None:
    """Checks, once per (arena, group, arena size), that every rank of `group` holds an arena of
    the same direction, slot count, history length and recipe, so the amax all-reduce that
    follows cannot hang or mix unrelated slots. A collective: every rank must call it.

    Args:
        arena: the Arena about to be all-reduced over `group`.
        group: a torch.distributed process group (None: nothing to check).

    Raises:
        RuntimeError: on every rank, naming each difference ("rank 1 has 12 forward FP8 slots,
            rank 0 has 9").
    """
    if not needs_reduction(group):
        return
    if arena.checked_groups.get(group) == arena.version:
        return
    mine = torch.tensor(_layout(arena), dtype=torch.int64, device=arena.device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    lines = _mismatches([r.tolist() for r in rows], arena.direction)
    if lines:
        raise RuntimeError(
            "graphfp8: the FP8 state differs across the ranks of fp8_group, so their amax "
            "all-reduce would hang or mix unrelated slots (every rank must run the same FP8 "
            "modules with the same recipe): " + "; ".join(lines)
        )
    arena.checked_groups[group] = arena.version


def check_arenas(arenas, group) -> None:
    """check_arena_consistency for each arena, in order (the same order on every rank)."""
    for arena in arenas:
        check_arena_consistency(arena, group)


def check_recipe_agrees(recipe, group) -> None:
    """Checks that every rank of `group` entered fp8_autocast with the same recipe, once per
    (group, recipe): ranks of other recipes would run other collectives (a delayed arena's amax
    all-reduce against none), which aborts gloo and hangs NCCL. A collective (all_gather_object)
    when the recipe is new to the group.

    Raises:
        RuntimeError: on every rank, naming each difference ("rank 1 has margin=1 in its
            recipe, rank 0 has margin=0").
    """
    if not needs_reduction(group):
        return
    mine = (type(recipe).__name__, {f.name: repr(getattr(recipe, f.name))
                                    for f in dataclasses.fields(recipe)})  # fmt: skip
    if AGREED_RECIPES.get(group) == mine:
        return
    rows: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, mine, group=group)
    lines = []
    for rank, (kind, fields) in enumerate(rows[1:], start=1):
        if kind != rows[0][0]:
            lines.append(f"rank {rank} has a {kind}, rank 0 a {rows[0][0]}")
            continue
        lines += [f"rank {rank} has {k}={v} in its recipe, rank 0 has {k}={rows[0][1][k]}"
                  for k, v in fields.items() if v != rows[0][1][k]]  # fmt: skip
    if lines:
        raise RuntimeError(
            "graphfp8: the ranks of fp8_group entered fp8_autocast with different recipes, so "
            "their amax reductions would not match (every rank must run the same FP8 recipe): "
            + "; ".join(lines)
        )
    AGREED_RECIPES[group] = mine
