"""tests/rank_pool.py itself: a rank process that dies while the others wait for it fails the
test at once with what killed it, instead of at the task timeout."""

from __future__ import annotations

import os
import resource
import signal
import time

import pytest
import torch.distributed as dist

from tests import rank_pool


def _die_while_rank_0_waits(rank, device, how):
    """exit: rank 0 reports at once and the test waits for rank 1, which exits after a while;
    segv: rank 0 waits in a collective that rank 1 never joins, crashing."""
    if rank == 1 and how == "exit":
        time.sleep(0.5)
        os._exit(3)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of this crash
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "segv":
        dist.barrier()


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("exit", r"rank 1 died \(exit code 3\)"),
        # faulthandler's stacks of the crash, in the rank's crash log
        ("segv", r"rank 1 died \(signal SIGSEGV\)\nrank 1's crash log:\n(.|\n)*_die_while"),
    ],
)
def test_a_dead_rank_fails_the_test_with_its_error(monkeypatch, how, match):
    # Well above the polling (rank_pool.POLL_S): without it, a TimeoutError after this long.
    monkeypatch.setattr(rank_pool, "TASK_TIMEOUT_S", 20)
    with pytest.raises(RuntimeError, match="_die_while_rank_0_waits: " + match):
        rank_pool.run_on_ranks("gloo", _die_while_rank_0_waits, how)
