"""LiveBytes: the bytes of the storages that ops allocate inside a region, followed as they live and
die - the CPU's stand-in for torch.cuda.max_memory_allocated (without allocator rounding or
fragmentation), and the list of what was alive at the peak. Storage Python objects stay attached
to their storage while C++ holds it, so a finalizer on one fires when the memory is freed, even
for a tensor only autograd still holds."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Follows every storage that an op allocates while the mode is active (views, in-place ops
    and out= writes allocate none).

    Attributes:
        live: bytes allocated inside the region and not freed yet.
        peak: the highest `live` seen.
        at_peak: {"op shape dtype": bytes} of the storages alive at the peak.

    Usage:
        with LiveBytes() as lb:
            model(x).backward(dy)
        lb.peak, lb.at_peak
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._alive: dict[int, tuple[int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view, or the tensor an in-place or out= op wrote
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
                self._track(t, f"{func._schema.name} {tuple(t.shape)} {t.dtype}")
        return out

    def _track(self, t: torch.Tensor, name: str) -> None:
        storage = t.untyped_storage()
        nbytes, key = storage.nbytes(), storage.data_ptr()
        if nbytes == 0 or key in self._alive:
            return
        self._alive[key] = (nbytes, name)
        self.live += nbytes
        weakref.finalize(storage, self._free, key)
        if self.live > self.peak:
            self.peak = self.live
            summary: dict[str, int] = {}
            for size, op in self._alive.values():
                summary[op] = summary.get(op, 0) + size
            self.at_peak = summary

    def _free(self, key: int) -> None:
        size, _ = self._alive.pop(key, (0, ""))
        self.live -= size
