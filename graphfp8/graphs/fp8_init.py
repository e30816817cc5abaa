"""The FP8 state of a capture: which modules it holds, their slots allocated before warmup, and the
arenas frozen once warmup has found them all (a captured graph keeps raw pointers to them)."""

from __future__ import annotations

from torch import nn

from graphfp8.fp8 import scaling
from graphfp8.fp8.arena_check import check_arenas
from graphfp8.modules.base import FP8Module

__all__ = ["fp8_modules_in", "freeze_arenas", "init_fp8_modules", "unique"]


def unique(items) -> list:
    """items without repeats (by identity), in first-seen order."""
    return list({id(x): x for x in items}.values())


def fp8_modules_in(trees) -> list[FP8Module]:
    """The FP8 modules of the module trees `trees`, each once, in order."""
    return [m for m in unique(m for t in trees for m in t.modules()) if isinstance(m, FP8Module)]


def init_fp8_modules(chunks: list[list[nn.Module]], recipe_of, device,
                     fp8_group) -> scaling.InitGroup:  # fmt: skip
    """Allocates the slots of each chunk's FP8 modules in fresh arenas (one init group per
    chunk: the chunks' modules share arenas as they would eagerly, where each chunk's first
    forward is its own fp8_autocast region), then checks, before warmup, that every rank of
    fp8_group holds the same arenas (raising on every rank otherwise). Modules reached otherwise
    (by a plain function) allocate during warmup, in the last chunk's group, which it returns.
    recipe_of(module): the recipe a module runs under, or None (a callable captured without FP8:
    its modules get no slots)."""
    arenas, group = [], scaling.InitGroup()
    for modules in chunks:
        group = scaling.InitGroup()  # the captured modules never share arenas with other models
        for m in modules:
            recipe = recipe_of(m)
            if recipe is not None and m.uses_fp8(recipe):
                meta = m.fp8_init(recipe, device, group)
                arenas += [meta.fwd.arena, meta.bwd.arena]
    check_arenas(sorted(unique(arenas), key=lambda a: a.serial), fp8_group)
    return group


def freeze_arenas(arenas, fp8_group) -> list[scaling.Arena]:
    """Checks the arenas that warmup reached across the ranks of fp8_group (never inside a
    capture: the check's all_gather and host read would be recorded), then freezes them.

    Returns:
        The arenas this call froze (not those frozen already), for undoing a failed capture.
    """
    arenas = sorted(arenas, key=lambda a: a.serial)
    check_arenas(arenas, fp8_group)
    newly = [a for a in arenas if not a.frozen]
    scaling.freeze(newly)
    return newly
