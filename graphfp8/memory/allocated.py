"""AllocatedBytes: the CPU allocator's own count of the bytes allocated inside a region and not
freed, through torch.profiler's memory events - the CPU's stand-in for
torch.cuda.max_memory_allocated that sees every storage, including a DTensor's local shard and
FSDP2's storage resizes (which LiveBytes, a dispatch mode, cannot), and every free, on whichever
thread (docs/sharding.md, "Memory planner")."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocatedBytes"]

# c10's CPU allocator keeps its process-wide count (each memory event's total_allocated) only for
# frees on threads the profiler follows, unless this flag is set: a buffer that gloo's worker
# thread frees (it drops the last reference to a collective's Work, and with it FSDP2's
# all-gather output or gloo's copy of a reduce-scatter's input) otherwise stays counted.
_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def _report_flag() -> ctypes.c_bool:
    """c10's caffe2_report_cpu_memory_usage flag (exported by libc10)."""
    for lib in sorted((Path(torch.__file__).parent / "lib").glob("libc10.*")):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), _FLAG)
        except (OSError, ValueError):
            continue
    raise RuntimeError(
        f"AllocatedBytes needs libc10's {_FLAG} (torch {torch.__version__} does not export "
        "it): measure with graphfp8.memory.LiveBytes instead"
    )


class AllocatedBytes:
    """The peak of the CPU allocator's bytes allocated inside the region, by any thread, net of
    what it freed, by any thread, when it freed them: the allocator's process-wide count (c10's
    report flag set for the region) less its count at the start, read at every memory event of
    the threads the profiler follows and once more at the end. Bytes allocated before the region
    and freed inside it do not count (the memory event of such a free is added back). Before,
    a block freed on another thread counted until its address was allocated again.

    Attributes:
        peak: the highest count of bytes allocated inside the region and alive (set on exit).
        live: the count at the region's end.

    Usage:
        with AllocatedBytes() as ab:
            train()
        ab.peak
    """

    def __init__(self) -> None:
        self.peak = 0
        self.live = 0
        self._flag = _report_flag()
        self._was = False
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> AllocatedBytes:
        self._was = self._flag.value
        self._flag.value = True
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            # one byte allocated last: its memory event samples the count after every free
            last = torch.empty(1, dtype=torch.uint8)
            last_ptr = last.data_ptr()
            del last
            self._profile.__exit__(*exc)
        finally:
            self._flag.value = self._was
        events = []
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                f = e.extra_fields
                events.append((e.start_time_ns, f.alloc_size, f.ptr, f.total_allocated))
            stack.extend(e.children)
        events.sort()
        end = max(i for i, (_, size, ptr, _) in enumerate(events) if ptr == last_ptr and size > 0)
        inside: set[int] = set()  # addresses allocated inside the region and not freed
        before = events[0][3] - events[0][1]  # the count before the region
        added_back = 0  # frees of blocks allocated before the region
        for _, size, ptr, total in events[:end]:
            if size > 0:
                inside.add(ptr)
            elif ptr in inside:
                inside.discard(ptr)
            else:
                added_back -= size
            self.peak = max(self.peak, total - before + added_back)
        self.live = events[end][3] - events[end][1] - before + added_back
        self.peak = max(self.peak, self.live)
