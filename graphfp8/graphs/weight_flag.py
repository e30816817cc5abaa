"""The is_first_microbatch device flag that captured weight casts read (WeightCacheFlag), refreshed
between replays of graphed callables and microbatch graphs."""

from __future__ import annotations

import torch

from graphfp8.fp8.autocast import check_is_first_microbatch

__all__ = ["WeightCacheFlag"]


class WeightCacheFlag:
    """The device flag that the captured weight casts read (1 = the cached FP8 weight is valid:
    the cast writes nothing; the kernels call such a flag `noop`).

    It is refreshed by an eager fill_ enqueued before a replay, only when its value changes: with
    N microbatches per step that is 2 fills per step (True -> 0, then False -> 1), none on the
    other replays. A stream-ordered device write cannot race with the replays around it, unlike
    a pinned host value read by a memcpy node of the graph.
    """

    def __init__(self, tensor: torch.Tensor | None, fp8_enabled: bool, caching: bool, name: str,
                 what: str):  # fmt: skip
        """name: the entry point ("make_graphed_microbatch"); what: what it returned, as the
        messages call it ("graphed microbatch")."""
        self.name, self.what = name, what
        self.tensor = tensor
        self.fp8_enabled = fp8_enabled
        self.caching = caching
        self.value = 0.0
        self.seen_first = False

    def set(self, is_first_microbatch) -> None:
        check_is_first_microbatch(is_first_microbatch)
        if self.tensor is None:
            if self.fp8_enabled and is_first_microbatch is not None:
                raise ValueError(
                    f"{self.name}(fp8_weight_caching=False) casts the weights on every replay; "
                    f"call the {self.what} with is_first_microbatch=None, or capture with "
                    "fp8_weight_caching=True"
                )
            return
        if is_first_microbatch is False:
            if not self.seen_first:
                raise RuntimeError(
                    f"{self.name}: the {self.what} was called with is_first_microbatch=False "
                    "before any call with is_first_microbatch=True: there is no cached FP8 "
                    "weight to reuse"
                )
            value = 1.0
        else:
            self.seen_first = self.seen_first or bool(is_first_microbatch)
            value = 0.0
        if value != self.value:
            self.tensor.fill_(value)
            self.value = value
