"""The weight-cache rule (`is_first_microbatch`) and its drivers.

The rule, TransformerEngine's: a forward with is_first_microbatch None or True casts the FP8
weights (and leaves them cached), one with False reuses the cached FP8 weights; False before any
cast raises (there is nothing to reuse). CacheState.reuses() is the rule, written once.

Its drivers:

    eager            a module's FP8 weight workspaces (WeightCache) and its host bool: the
                     forward casts or not (policy EAGER)
    device flag      a graph's weight casts read a (1,) float32 device flag (1 = reuse: the cast
                     writes nothing; the kernels call it `noop`). Graphed callables and microbatch
                     graphs fill it between replays, only when its value changes (DeviceFlag)
    per microbatch   a step graph knows at capture which microbatch it records: microbatch 0
                     records the casts, the others none at all (step_casts: no no-op cast nodes
                     on the cached microbatches, no flag, no fill between replays)

Under Float8BlockScaling the same rule and drivers decide whether a weight's 128x128 blocks
are quantized into its BlockWorkspace or read from it (modules/_context.py, blockwise_weights).

A model that carries its recipe (graphfp8/modules/carry.py) runs its calls given no
is_first_microbatch under EAGER: each casts (docs/fp8.md, "The carried recipe" says why no
cheaper rule is safe there).

The policy a context carries (graphfp8/fp8/context.py) says which decides: EAGER,
GraphCasts(flag) - inside a capture, where every weight cast is recorded and the flag decides
on the device (None: the graphs cast on every replay) - or StaticCasts(cast) - inside a capture
that decides on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphfp8.fp8.tensor import Float8Tensor

__all__ = ["EAGER", "BlockWeight", "BlockWorkspace", "CacheState", "DeviceFlag", "EagerCasts",
           "GraphCasts", "StaticCasts", "WeightCache", "WeightCachePolicy",
           "check_is_first_microbatch", "step_casts"]  # fmt: skip


def check_is_first_microbatch(is_first_microbatch) -> None:
    """Eager modules and graphed callables take None, True or False, nothing else."""
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise TypeError(
            f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}"
        )


class CacheState:
    """Whether cached FP8 weights exist to reuse."""

    def __init__(self) -> None:
        self.valid = False

    def reuses(self, is_first_microbatch: bool | None, error: str) -> bool:
        """The rule: True when this call reuses the cached weights; a call that casts leaves
        them valid. Raises RuntimeError(error) for False with nothing cached."""
        if is_first_microbatch is None or is_first_microbatch:
            self.valid = True
            return False
        if not self.valid:
            raise RuntimeError(error)
        return True


def flag_value(reuse: bool) -> float:
    """The device flag's value: 1 reuses the cache (the cast writes nothing), 0 casts."""
    return 1.0 if reuse else 0.0


class WeightCache(CacheState):
    """One module's FP8 weight workspaces ({key: Float8Tensor}, and a BlockWorkspace under
    "key:blocks" for Float8BlockScaling) and whether they hold its
    current weights. Only the module and its context reader use it; captures save and restore
    it through snapshot() / restore()."""

    def __init__(self) -> None:
        super().__init__()
        self.workspaces: dict[str, Float8Tensor] = {}
        self.why_stale: str | None = None  # what invalidated a cast (the error of a next False)
        self.kind: str | None = None  # what the last casts wrote: "per-tensor" or "blockwise"

    def use_kind(self, kind: str) -> None:
        """A forward under per-tensor or blockwise scaling (`kind`): the cache holds the casts
        of one kind at a time, so after casts of the other kind there is nothing to reuse."""
        if self.kind is not None and kind != self.kind:
            self.invalidate(f"they were last cast under {self.kind} scaling")
        self.kind = kind

    def invalidate(self, why: str = "load_state_dict wrote the weights") -> None:
        """The weights changed behind the cache: the next False raises, saying `why` when
        something was cast before."""
        self.why_stale = why if self.valid or self.why_stale else None
        self.valid = False

    def snapshot(self) -> tuple:
        return dict(self.workspaces), self.valid

    def restore(self, snap: tuple) -> None:
        workspaces, self.valid = snap
        self.workspaces = dict(workspaces)

    def workspace(self, key: str, weight: torch.Tensor, fp8_dtype, with_t: bool,
                  owner: str) -> Float8Tensor:  # fmt: skip
        """The FP8 workspace of weight `key` (N, K), (re)allocated when its shape, device,
        dtypes or transpose cache no longer match (then the cache is stale). An FP8 primary
        weight is its own workspace: only its transpose buffer is kept or dropped here."""
        if isinstance(weight, Float8Tensor):
            if weight.fp8_dtype != fp8_dtype:
                raise TypeError(
                    f"{owner}: FP8 primary weight {key} is {weight.fp8_dtype}, the recipe's "
                    f"forward format is {fp8_dtype}"
                )
            if not with_t:  # the backward transposes the data instead
                weight._transpose, weight._transpose_valid = None, False
            elif weight._transpose is None:
                rows, cols = weight._data.shape
                weight._transpose = torch.empty(cols, rows, dtype=fp8_dtype, device=weight.device)
            return weight
        ws = self.workspaces.get(key)
        if (
            ws is None
            or ws._data.shape != weight.shape
            or ws.device != weight.device
            or ws.dtype != weight.dtype
            or ws.fp8_dtype != fp8_dtype
            or (ws._transpose is not None) != with_t
        ):
            shape, device = tuple(weight.shape), weight.device
            if with_t:
                ws = Float8Tensor.empty(shape, fp8_dtype, weight.dtype, device)
            else:
                data = torch.empty(shape, dtype=fp8_dtype, device=device)
                ws = Float8Tensor(data, torch.ones(1, device=device), weight.dtype)
            self.workspaces[key] = ws
            self.valid = False
        return ws


class BlockWorkspace:
    """One weight's cached Float8BlockScaling quantization (docs/fp8.md, "Blockwise scaling"):
    its 128x128 blocks and (with_t: the module's cache_weight_transpose) their transpose, as
    graphfp8.ops.blockwise.quantize(w, 128, transpose=with_t) writes them. The memory report
    reads _data, _scale_inv and _transpose as a Float8Tensor's."""

    def __init__(self, weight: torch.Tensor, power_2_scale: bool, with_t: bool) -> None:
        (n, k), device = weight.shape, weight.device
        nb, kb = -(-n // 128), -(-k // 128)
        e4m3, f32 = torch.float8_e4m3fn, torch.float32
        self._data = torch.empty(n, k, dtype=e4m3, device=device)
        self._scale_inv = torch.empty(nb, kb, dtype=f32, device=device)
        self._transpose = torch.empty(k, n, dtype=e4m3, device=device) if with_t else None
        self._scale_inv_t = torch.empty(kb, nb, dtype=f32, device=device) if with_t else None
        self.key = (tuple(weight.shape), device, weight.dtype, power_2_scale, with_t)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """(w_fp8 (N, K), scale_inv[, w_t_fp8 (K, N), scale_inv_t]): the quantizer's `out`."""
        if self._transpose is None:
            return self._data, self._scale_inv
        return self._data, self._scale_inv, self._transpose, self._scale_inv_t


@dataclass(frozen=True, eq=False)
class BlockWeight:
    """One blockwise GEMM weight of a forward: its cache workspace, whether this call quantizes
    into it (else it reads it), and the device flag that quantization reads (1: write nothing;
    None: write)."""

    workspace: BlockWorkspace
    cast: bool
    flag: torch.Tensor | None


def block_workspace(cache: WeightCache, key: str, weight: torch.Tensor, power_2_scale: bool,
                    with_t: bool) -> BlockWorkspace:  # fmt: skip
    """The blockwise workspace of weight `key` (N, K) in `cache` (under its own key beside the
    per-tensor workspaces), (re)allocated when its shape, device, dtype, scale rule or
    transpose cache no longer match (then the cache is stale)."""
    name = key + ":blocks"
    ws = cache.workspaces.get(name)
    want = (tuple(weight.shape), weight.device, weight.dtype, power_2_scale, with_t)
    if ws is None or ws.key != want:
        ws = BlockWorkspace(weight, power_2_scale, with_t)
        cache.workspaces[name] = ws
        cache.valid = False
    return ws


def _nothing_cached(owner: str, cache) -> str:
    why = getattr(cache, "why_stale", None)
    if why is not None:  # it was cast before: say what made the cached weights stale
        return (f"{owner}: is_first_microbatch=False, but its cached FP8 weights are stale "
                f"({why}): there is no cached FP8 weight of the current weights to reuse; pass "
                "is_first_microbatch=True (or None) on the next forward to cast them")  # fmt: skip
    return (f"{owner}: is_first_microbatch=False before any is_first_microbatch=True: there is "
            "no cached FP8 weight to reuse")  # fmt: skip


@dataclass(frozen=True)
class EagerCasts:
    """The module's is_first_microbatch decides on the host, per call."""

    def check(self, cache: WeightCache, is_first_microbatch, owner: str) -> None:
        """Raises, before the forward touches any FP8 state, where casts() would."""
        if is_first_microbatch is False and not cache.valid:
            raise RuntimeError(_nothing_cached(owner, cache))

    def casts(self, cache: WeightCache, is_first_microbatch, owner: str):
        """(cast the weights now, the device flag the casts read: None)."""
        return not cache.reuses(is_first_microbatch, _nothing_cached(owner, cache)), None


@dataclass(frozen=True, eq=False)
class GraphCasts:
    """Inside a capture: every weight cast is recorded, and `flag` ((1,) float32 device tensor,
    or None: cast on every replay) decides on the device."""

    flag: torch.Tensor | None

    def check(self, cache: WeightCache, is_first_microbatch, owner: str) -> None:
        """Nothing to check: the graph's device flag decides at replay."""

    def casts(self, cache: WeightCache, is_first_microbatch, owner: str):
        # The workspaces now hold what the graph casts (its flag decides): an eager call with
        # is_first_microbatch=False after a replay reuses them.
        cache.valid = True
        return True, self.flag


@dataclass(frozen=True)
class StaticCasts:
    """Inside a capture that knows whether this microbatch casts (a step graph): `cast` records
    the weight casts unconditionally; otherwise none is recorded, and the forward reads the
    workspaces that an earlier microbatch of the same graph cast (issue 33: 4 graph nodes fewer
    per layer on each cached microbatch)."""

    cast: bool

    def check(self, cache: WeightCache, is_first_microbatch, owner: str) -> None:
        """Nothing to check before the forward: casts() checks the capture's own order."""

    def casts(self, cache: WeightCache, is_first_microbatch, owner: str):
        """(cast the weights now, no device flag)."""
        if not (self.cast or cache.valid):
            raise RuntimeError(f"{owner}: a step graph's microbatch reuses FP8 weights that no "
                               "earlier microbatch cast")  # fmt: skip
        cache.valid = True
        return self.cast, None


WeightCachePolicy = EagerCasts | GraphCasts | StaticCasts
EAGER = EagerCasts()


class DeviceFlag:
    """The device flag of a graphed callable or microbatch graph, filled from each call's
    is_first_microbatch: an eager fill_ enqueued before the replay, only when its value changes
    (with N microbatches per step, 2 fills per step: True -> 0, then False -> 1). A
    stream-ordered device write cannot race with the replays around it, unlike a pinned host
    value read by a memcpy node of the graph.

    Args:
        device: where the flag lives.
        fp8_enabled, caching: the capture's fp8_enabled and fp8_weight_caching (no flag
            without both: the graphs cast on every replay, and only None is accepted).
        name: the entry point ("make_graphed_microbatch"); what: what it returned, as the
            messages call it ("graphed microbatch").
    """

    def __init__(self, device, fp8_enabled: bool, caching: bool, name: str, what: str):
        self.name, self.what, self.fp8_enabled = name, what, fp8_enabled
        self.tensor = torch.zeros(1, device=device) if fp8_enabled and caching else None
        self.state = CacheState()
        self.value = 0.0
        self._nothing_cached = (f"{name}: the {what} was called with is_first_microbatch=False "
                                "before any call with is_first_microbatch=True: there is no "
                                "cached FP8 weight to reuse")  # fmt: skip

    @property
    def policy(self) -> GraphCasts:
        return GraphCasts(self.tensor)

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
        value = flag_value(self.state.reuses(is_first_microbatch, self._nothing_cached))
        if value != self.value:
            self.tensor.fill_(value)
            self.value = value


def step_casts(n: int, caching: bool) -> list[WeightCachePolicy]:
    """A step graph's policy per microbatch: the rule with is_first_microbatch = (i == 0) decided
    at capture (StaticCasts), or GraphCasts(None) each without caching (cast every time)."""
    if not caching:
        return [GraphCasts(None)] * n
    state, error = CacheState(), "unreachable: microbatch 0 casts"
    return [StaticCasts(not state.reuses(i == 0, error)) for i in range(n)]
