"""The options every capture entry point takes, as one frozen value validated on construction
(the pattern of torchao's Float8LinearConfig): make_graphed_callables, make_graphed_microbatch and
make_graphed_step each build one from their TransformerEngine-style keyword arguments and hand it
to the capture session (graphs/session.py).

Their fp8_weight_caching defaults differ on purpose. make_graphed_callables keeps
TransformerEngine's (False: every replay casts the weights, and a call must not pass
is_first_microbatch), and make_graphed_microbatch follows it, because both leave the choice of
the first microbatch to the caller's is_first_microbatch. make_graphed_step knows which
microbatch is first - it holds them all - so caching costs its caller nothing and is the default
(True: microbatch 0 casts, the others reuse the cache, as the eager loop with
is_first_microbatch=(i == 0) does).

make_graphed_callables also takes fp8_enabled (and fp8_recipe) as a tuple with one entry per
callable (TransformerEngine's per-callable fp8_enabled): a model may keep some layers in bf16, or
run them under another recipe, in one graph set (docs/fp8.md, "A recipe per callable").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphfp8.fp8.recipe import DelayedScaling, Recipe, check_recipe

__all__ = ["CaptureOptions"]


@dataclass(frozen=True, eq=False)
class CaptureOptions:
    """One capture's options (the entry points' arguments of the same names).

    Attributes:
        entry: the entry point ("make_graphed_step"), for messages.
        fp8_enabled: run graphfp8 modules in FP8 inside the graphs; with `callables`, a tuple of
            one bool per callable may be given. After construction: whether any runs in FP8.
        fp8_recipe: the recipe given (None: DelayedScaling() when fp8_enabled); with
            `callables`, a tuple of one recipe (or None) per callable may be given.
        fp8_weight_caching: the captured weight casts read a weight-cache flag.
        fp8_group: torch.distributed group whose ranks MAX-reduce amaxes with every update.
        num_warmup_iters: eager iterations before capture.
        pool: a memory pool handle shared with other graphs (CUDA), or None.
        min_warmup: the fewest warmup iterations the entry point needs without FP8.
        callables: how many callables the capture holds (make_graphed_callables), or None
            (the microbatch and step graphs: one FP8 setting for the whole graph).
        recipe: the recipe the graphs run under (None without FP8; with per-callable settings
            the first FP8 callable's), set on construction.
        recipes: the recipe of each callable (None where it runs without FP8), set on
            construction; one entry without `callables`.
    """

    entry: str
    fp8_enabled: bool = False
    fp8_recipe: Recipe | None = None
    fp8_weight_caching: bool = False
    fp8_group: object = None
    num_warmup_iters: int = 3
    pool: object = None
    min_warmup: int = 0
    callables: int | None = None
    recipe: Recipe | None = field(init=False)
    recipes: tuple = field(init=False)

    def __post_init__(self) -> None:
        name, iters, minimum = self.entry, self.num_warmup_iters, self.min_warmup
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < minimum:
            raise ValueError(f"{name}: num_warmup_iters must be an int >= {minimum}, got {iters!r}")
        recipes = _per_callable(name, self.fp8_enabled, self.fp8_recipe, self.callables)
        enabled = any(r is not None for r in recipes)
        if enabled and iters < 1:
            raise ValueError(
                f"{name}: fp8_enabled needs num_warmup_iters >= 1: the warmup finds the FP8 "
                "arenas whose scale updates the graphs hold (without it they held none, and "
                "every scale stayed 1.0)"
            )
        object.__setattr__(self, "fp8_enabled", enabled)
        object.__setattr__(self, "recipes", recipes)
        object.__setattr__(self, "recipe", next((r for r in recipes if r is not None), None))

    @property
    def caching(self) -> bool:
        """The graphs hold weight-cache flags (FP8 with fp8_weight_caching)."""
        return self.fp8_enabled and self.fp8_weight_caching

    @property
    def all_recipes(self) -> list[Recipe]:
        """The distinct recipes the graphs run under, in callable order."""
        return list({id(r): r for r in self.recipes if r is not None}.values())


def _per_callable(name: str, enabled, recipe, count: int | None) -> tuple:
    """The recipe of each callable (None where FP8 is off), from fp8_enabled and fp8_recipe (a
    value, or with `count` a tuple of `count` values each); raises before anything runs on a
    tuple where one value is allowed, a wrong length or a non-bool flag."""
    flags = _spread(name, "fp8_enabled", enabled, count, "a bool")
    recipes = _spread(name, "fp8_recipe", recipe, count, "a recipe or None")
    if isinstance(enabled, tuple):
        for j, flag in enumerate(flags):
            if not isinstance(flag, bool):
                raise TypeError(
                    f"{name}: fp8_enabled as a tuple takes one bool per callable, got {flag!r} "
                    f"for callable {j}"
                )
    for r in recipes:
        check_recipe(r, f"{name}: fp8_recipe")
    default = DelayedScaling()
    return tuple((r or default) if f else None for f, r in zip(flags, recipes, strict=True))


def _spread(name: str, what: str, value, count: int | None, kind: str) -> list:
    """`value` once per callable: a tuple of `count` values, or one value repeated."""
    if not isinstance(value, (tuple, list)):
        return [value] * (1 if count is None else count)
    if count is None:
        raise TypeError(
            f"{name}: {what} must be {kind}, got {value!r}; one value per callable is "
            "make_graphed_callables' (use fp8_autocast(enabled=...) regions inside the captured "
            "function to keep some layers out of FP8)"
        )
    if isinstance(value, list) or len(value) != count:
        raise ValueError(
            f"{name}: {what} as a tuple needs one entry per callable ({count}), got "
            f"{len(value)} entries: {value!r}"
        )
    return list(value)
