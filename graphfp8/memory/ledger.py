"""Storage bookkeeping for the memory report: every tensor storage counted once, under the first
category that claims it (parameters before grads before FP8 weights ... before saved
activations), so the categories add up to the memory that the tensors really hold."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["Claim", "Ledger", "block_bytes", "storage_key", "tensor_parts"]

# The CUDA caching allocator hands out blocks in multiples of 512 bytes (512 at least).
_BLOCK = 512


def block_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator reserves for an allocation of `nbytes`."""
    return max(_BLOCK, -(-nbytes // _BLOCK) * _BLOCK) if nbytes else 0


def storage_key(t: torch.Tensor) -> tuple | None:
    """(device, data pointer) of t's storage, or None for an empty or storage-less tensor."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage.data_ptr())


def tensor_parts(t: torch.Tensor):
    """The plain tensors behind t: a DTensor's local shard (FSDP2: what this rank holds), a
    Float8Tensor's data, scale_inv and transpose; t itself otherwise. Yields (suffix, tensor)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        yield from tensor_parts(local)
        return
    inner = getattr(t, "_data", None)
    if isinstance(inner, torch.Tensor) and type(t) is not torch.Tensor:
        yield ".data", inner
        yield ".scale_inv", t._scale_inv
        if getattr(t, "_transpose", None) is not None:
            yield ".transpose", t._transpose
        return
    yield "", t


@dataclass
class Claim:
    """One tensor as the report lists it.

    Attributes:
        label: where it was found ("fc1 workspace .data", "_saved_input", ...).
        shape, dtype: the tensor's (a view may show less than its storage).
        nbytes: bytes of its whole storage.
        owner: the category its storage is counted under.
        counted: True where this entry is the one that counts the storage.
        first_label: the label under which the storage was counted.
    """

    label: str
    shape: tuple
    dtype: str
    nbytes: int
    owner: str
    counted: bool
    first_label: str = ""

    def to_dict(self) -> dict:
        return dict(label=self.label, shape=list(self.shape), dtype=self.dtype,
                    bytes=self.nbytes, owner=self.owner, counted=self.counted)  # fmt: skip


@dataclass
class Ledger:
    """Storages seen so far: their owning category, and the bytes of each category."""

    owner: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    blocks: dict = field(default_factory=lambda: defaultdict(int))
    items: dict = field(default_factory=lambda: defaultdict(list))

    def claim(self, t: torch.Tensor, category: str, label: str) -> list[Claim]:
        """Counts t's storages under `category` unless another category holds them already.
        Returns one Claim per plain tensor behind t."""
        out = []
        for suffix, part in tensor_parts(t):
            key = storage_key(part)
            nbytes = part.untyped_storage().nbytes() if key is not None else 0
            counted = key is not None and key not in self.owner
            if counted:
                self.owner[key] = category
                self.sizes[key] = nbytes
                self.labels[key] = label + suffix
                self.bytes[category] += nbytes
                self.blocks[category] += block_bytes(nbytes)
            dtype = str(part.dtype).replace("torch.", "")
            owner, first = self.owner.get(key, category), self.labels.get(key, "")
            claim = Claim(label + suffix, tuple(part.shape), dtype, nbytes, owner, counted, first)
            if counted:
                self.items[category].append(claim)
            out.append(claim)
        return out

    def holds(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self.owner
