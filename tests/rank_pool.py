"""Ranks for the data-parallel tests: `world` processes (WORLD = 2 unless a test asks for another
size, e.g. 3 for uneven shards) spawned once per (backend, world) and kept alive, so each test
pays one task round trip instead of starting interpreters (~1.5 s each). The ranks are forked
from multiprocessing's forkserver, which imports torch and graphfp8 once per session (a fresh
interpreter that has run no op, so no thread pool is forked), instead of spawning an interpreter
that imports them per rank (gloo; NCCL ranks are spawned, each initialising CUDA itself).

Each rank joins its process group once, then runs tasks `worker(rank, device, *args)` sent by
`run_on_ranks`, starting each from a fresh graphfp8 state and the same seed. A rank's failure is
re-raised in the test with its traceback; a rank that hangs (a mismatched collective) or dies
takes the pool down, and the next test starts a new one. A rank process that dies (a crash, a
kill, os._exit) fails the test within POLL_S, not at the task timeout, with its exit code and
what faulthandler wrote at the death (the Python stacks of a fatal signal).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
COLLECTIVE_TIMEOUT_S = 30  # a mismatched collective fails instead of hanging
TASK_TIMEOUT_S = 120  # one task on all ranks, the pool's start included
GRACE_S = 5.0  # after one rank failed, how long the others get to report
POLL_S = 0.2  # how often a waiting test checks that every rank process is alive

_POOLS: dict[tuple[str, int], _Pool] = {}

START_METHOD = "forkserver"
mp.get_context(START_METHOD).set_forkserver_preload(
    ["torch", "torch.distributed", "graphfp8", "graphfp8.distributed"]
)


def _crash_log(store: str, rank: int) -> str:
    """Where rank `rank`'s faulthandler writes the stacks of a fatal signal."""
    return f"{store}.rank{rank}.crash"


def _serve(rank: int, world: int, backend: str, store: str, tasks, results) -> None:
    """A rank process: _join_and_serve, with a crash log of what kills it (a fatal signal's
    stacks, through faulthandler, or an exception outside the tasks)."""
    with open(_crash_log(store, rank), "w") as crash_log:
        faulthandler.enable(crash_log, all_threads=True)
        try:
            _join_and_serve(rank, world, backend, store, tasks, results)
        except BaseException:
            crash_log.write(traceback.format_exc())
            raise
        finally:
            faulthandler.disable()


def _join_and_serve(rank: int, world: int, backend: str, store: str, tasks, results) -> None:
    """A rank's loop: join the group, then run tasks until told to stop (None)."""
    import graphfp8 as g8
    from graphfp8.distributed import cleanup

    torch.set_num_threads(1)  # the ranks share the CI machine's cores
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    gc.freeze()  # the imports' objects: the collection after each task scans only newer ones
    try:
        while (task := tasks.get()) is not None:
            worker, args = task
            g8.reset_state()
            torch.manual_seed(1234)
            try:
                worker(rank, device, *args)
                results.put((rank, None))
            except BaseException:  # noqa: BLE001 - reported to the test, which re-raises
                results.put((rank, traceback.format_exc()))
            gc.collect()  # graphs (and the tapes' group references) of the finished task
    finally:
        cleanup()


class _Pool:
    def __init__(self, backend: str, world: int):
        ctx = mp.get_context(START_METHOD if backend == "gloo" else "spawn")  # CUDA: fresh
        self.world = world
        self.store = tempfile.mkdtemp(prefix="graphfp8_ranks_") + "/store"
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, world, backend, self.store, self.tasks[r], self.results),
                daemon=True,
            )  # fmt: skip
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, worker, args, name: str) -> None:
        for q in self.tasks:
            q.put((worker, args))
        errors, done = {}, set()
        deadline = time.monotonic() + TASK_TIMEOUT_S
        while len(done) < self.world:
            if errors:
                deadline = min(deadline, time.monotonic() + GRACE_S)
            left = deadline - time.monotonic()
            try:
                rank, error = self.results.get(timeout=max(0.0, min(POLL_S, left)))
            except queue.Empty:
                self._raise_if_dead(name, done, errors)
                if left > POLL_S:
                    continue
                self.close()
                missing = sorted(set(range(self.world)) - done)
                if errors:
                    break  # the others are stuck in a collective the failed rank never joined
                raise TimeoutError(f"{name}: ranks {missing} did not finish in time") from None
            done.add(rank)
            if error is not None:
                errors[rank] = error
        if errors:
            rank = min(errors)
            raise AssertionError(f"{name} failed on rank {rank}:\n{errors[rank]}")

    def _raise_if_dead(self, name: str, done: set, errors: dict) -> None:
        """Closes the pool and raises if a rank that owes a result has died: its exit code and
        crash log, and what the other ranks reported (their side of the broken collective)."""
        dead = [r for r, p in enumerate(self.procs) if r not in done and not p.is_alive()]
        if not dead:
            return
        self.close()
        lines = []
        for r in dead:
            code = self.procs[r].exitcode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            lines.append(f"rank {r} died ({how})")
            crash = ""
            with contextlib.suppress(OSError), open(_crash_log(self.store, r)) as f:
                crash = f.read().strip()
            if crash:
                lines.append(f"rank {r}'s crash log:\n{crash}")
        lines += [f"rank {r} reported:\n{e}" for r, e in sorted(errors.items())]
        raise RuntimeError(f"{name}: " + "\n".join(lines))

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        for key, pool in list(_POOLS.items()):
            if pool is self:
                del _POOLS[key]


def run_on_ranks(backend: str, worker, *args, world: int = WORLD) -> None:
    """Runs worker(rank, device, *args) on `world` ranks of `backend` ("gloo": CPU, "nccl": one
    GPU per rank); re-raises the first failing rank's exception text. worker must be a
    module-level function (it is pickled by name)."""
    pool = _POOLS.get((backend, world))
    if pool is None or any(not p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _POOLS[backend, world] = _Pool(backend, world)
    try:
        pool.run(worker, args, worker.__name__)
    except (AssertionError, TimeoutError, RuntimeError):
        if any(not p.is_alive() for p in pool.procs):
            pool.close()
        raise


def shutdown() -> None:
    """Stops every pool (at the end of the test session): all ranks are told to stop before any
    is waited for, so the pools leave their process groups at the same time."""
    pools = list(_POOLS.values())
    for pool in pools:
        for q in pool.tasks:
            q.put(None)
    deadline = time.monotonic() + 10.0
    for pool in pools:
        for p in pool.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        pool.close()
