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
        fp8_enabled: run graphfp8 modules in FP8 inside the graphs.
        fp8_recipe: the recipe given (None: DelayedScaling() when fp8_enabled).
        fp8_weight_caching: the captured weight casts read a weight-cache flag.
        fp8_group: torch.distributed group whose ranks MAX-reduce amaxes with every update.
        num_warmup_iters: eager iterations before capture.
        pool: a memory pool handle shared with other graphs (CUDA), or None.
        min_warmup: the fewest warmup iterations the entry point needs without FP8.
        recipe: the recipe the graphs run under (None without FP8), set on construction.
    """

    entry: str
    fp8_enabled: bool = False
    fp8_recipe: Recipe | None = None
    fp8_weight_caching: bool = False
    fp8_group: object = None
    num_warmup_iters: int = 3
    pool: object = None
    min_warmup: int = 0
    recipe: Recipe | None = field(init=False)

    def __post_init__(self) -> None:
        name, iters, minimum = self.entry, self.num_warmup_iters, self.min_warmup
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < minimum:
            raise ValueError(f"{name}: num_warmup_iters must be an int >= {minimum}, got {iters!r}")
        if self.fp8_enabled and iters < 1:
            raise ValueError(
                f"{name}: fp8_enabled needs num_warmup_iters >= 1: the warmup finds the FP8 "
                "arenas whose scale updates the graphs hold (without it they held none, and "
                "every scale stayed 1.0)"
            )
        check_recipe(self.fp8_recipe, f"{name}: fp8_recipe")
        recipe = (self.fp8_recipe or DelayedScaling()) if self.fp8_enabled else None
        object.__setattr__(self, "recipe", recipe)

    @property
    def caching(self) -> bool:
        """The graphs hold weight-cache flags (FP8 with fp8_weight_caching)."""
        return self.fp8_enabled and self.fp8_weight_caching
