"""graphfp8.memory.AllocatedBytes (the CPU accounting of FSDP2 runs in tests/test_memory_plan.py)
against known allocations: a block freed on a thread the profiler does not follow (gloo's worker
frees a collective's buffers: FSDP2's all-gather output, gloo's copy of a reduce-scatter's input)
counts until it is freed, not until its address is allocated again; blocks allocated before the
region and freed inside it do not count; c10's report flag is set for the region only."""

from __future__ import annotations

import threading

import torch

from graphfp8.memory import AllocatedBytes
from graphfp8.memory.allocated import _report_flag

MIB = 1 << 20


def _free_on_another_thread(box: list) -> None:
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()


def test_a_block_freed_on_another_thread_counts_until_freed():
    """Before: live 4 MiB at the end (the free never seen, the address not allocated again) and
    peak 6 MiB once a second block was allocated beside the counted one."""
    box = []
    with AllocatedBytes() as ab:
        box.append(torch.empty(MIB, dtype=torch.uint8).fill_(1))  # 1 MiB
        _free_on_another_thread(box)
    assert (ab.peak, ab.live) == (MIB, 0)
    with AllocatedBytes() as ab:
        box.append(torch.empty(4 * MIB, dtype=torch.uint8))
        _free_on_another_thread(box)
        kept = torch.empty(2 * MIB, dtype=torch.uint8)
    assert (ab.peak, ab.live) == (4 * MIB, 2 * MIB), kept.shape


def test_blocks_allocated_before_the_region_do_not_count():
    before = torch.empty(3 * MIB, dtype=torch.uint8)
    with AllocatedBytes() as first:
        counted = torch.empty(MIB, dtype=torch.uint8)
    del counted  # freed outside any region: c10 keeps its size, as it does after the region
    again = torch.empty(MIB, dtype=torch.uint8)
    with AllocatedBytes() as ab:
        del before, again
        kept = torch.empty(MIB // 2, dtype=torch.uint8)
    assert (first.peak, first.live) == (MIB, MIB)
    assert (ab.peak, ab.live) == (MIB // 2, MIB // 2), kept.shape


def test_the_report_flag_is_set_for_the_region_only():
    flag = _report_flag()
    assert not flag.value
    with AllocatedBytes():
        assert flag.value
    assert not flag.value
