"""AllocatedBytes: the CPU allocator's own count of the bytes allocated inside a region and not
freed, through torch.profiler's memory events - the CPU's stand-in for
torch.cuda.max_memory_allocated that sees every storage, including a DTensor's local shard and
FSDP2's storage resizes (which LiveBytes, a dispatch mode, cannot: docs/sharding.md, "Memory
planner")."""

from __future__ import annotations

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocatedBytes"]


class AllocatedBytes:
    """The peak of the CPU allocator's bytes allocated by this thread (and the threads autograd
    runs on) inside the region, net of what it freed; the bytes allocated before the region and
    freed inside it do not count. A block freed on another thread counts until its address is
    allocated again (an upper bound).

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
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> AllocatedBytes:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        events = []
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
            stack.extend(e.children)
        # a block freed on a thread the profiler does not follow (gloo's, holding a collective's
        # buffers) reports no free: an address allocated again was freed before
        alive: dict[int, int] = {}
        for _, size, ptr in sorted(events):
            self.live -= alive.pop(ptr, 0)
            if size > 0:
                alive[ptr] = size
                self.live += size
                self.peak = max(self.peak, self.live)
