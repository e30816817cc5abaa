"""Switches between CUDA kernel variants (csrc/ops/switches.h): a new kernel lands off until it
has run on a GPU; the first two below ran on the H200 on 2026-12-01 and are on by default.

Each switch starts from its environment variable (GRAPHFP8_<NAME>=0 turns it off, read once when
the extension loads) and can be flipped at run time, which is how the CUDA tests compare a new
kernel with the one it replaces in one process. docs/benchmarking.md lists them.

    NORM_BWD_BATCHED   the norm backward with several rows in flight per block and the fast
                       fixed-order parameter-gradient reduction (bit-identical results)
    PAIRED_QUANTIZE    the cast-transposes' FP8 conversion two values per instruction and
                       word-wide transposed stores (bit-identical results)
    DBIAS_IN_KERNEL    (off) the fused dbias's column sums by the last block of each column of
                       tiles, not a second kernel: one launch fewer (bit-identical results)
    NORM_BWD_PIPELINED (off) the batched norm backward with the next rows' loads in flight
                       during the current rows' sums and stores (bit-identical results)
    ROPE_PARTS_BWD     (off) the bf16 attention path's RoPE backward reads dq, dk, dv in one
                       kernel instead of a cat and rope_qkv (bit-identical; the CPU always does)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from graphfp8.ops._lib import _C

__all__ = ["SWITCHES", "kernel_switch", "switch_on"]

SWITCHES = (
    "NORM_BWD_BATCHED",
    "PAIRED_QUANTIZE",
    "DBIAS_IN_KERNEL",
    "NORM_BWD_PIPELINED",
    "ROPE_PARTS_BWD",
)


def switch_on(name: str) -> bool:
    """Whether the kernel switch `name` (one of SWITCHES) is on."""
    return bool(_C.get_kernel_switch(name))


@contextlib.contextmanager
def kernel_switch(name: str, on: bool = True) -> Iterator[None]:
    """Runs the block with the kernel switch `name` set to `on`, then restores it."""
    before = _C.set_kernel_switch(name, on)
    try:
        yield
    finally:
        _C.set_kernel_switch(name, before)
