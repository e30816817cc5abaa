"""Every collective graphfp8 issues replays on the CPU tape exactly as it runs eagerly (gloo, 2 and
3 ranks): the amax MAX all-reduce, the bucketed gradient all-reduce (async, waited later), the
sharded masters' reduce-scatter and all-gather (FP8 as uint8). Failed before graphs/tape.py
waited for a collective inside the recorder: gloo's reduce-scatter copies its result out of an
internal buffer in Work.wait(), which the tape recorded and replayed over every later result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphfp8.distributed import allreduce_gradients
from graphfp8.distributed.collectives import all_gather_, max_all_reduce_, reduce_scatter_
from graphfp8.graphs import RecordingMode, ReplayTape
from graphfp8.testing import assert_bitwise_equal
from tests.rank_pool import run_on_ranks

S = 5  # elements of each rank's slice


class _Buffers:
    """The inputs and outputs of one round of collectives, at fixed addresses (a graph's)."""

    def __init__(self, world: int):
        self.x = torch.zeros(world * S)
        self.amax = torch.zeros(3)
        self.grad = torch.zeros(7, dtype=torch.bfloat16)
        self.shard = torch.zeros(S)
        self.fp8 = torch.zeros(world * S, dtype=torch.float8_e4m3fn)
        self.out = torch.zeros(world * S)

    def fill(self, seed: int, rank: int) -> None:
        gen = torch.Generator().manual_seed(1000 * seed + rank)
        for t in (self.x, self.amax, self.grad):
            t.copy_(torch.randn(t.shape, generator=gen))
        self.grad.grad = None

    def run(self, rank: int, group) -> None:
        """The collectives, each reading what the one before it wrote."""
        max_all_reduce_(self.amax, group)
        p = torch.nn.Parameter(self.grad.clone())
        p.grad = self.grad  # allreduce_gradients: async all-reduce, waited later, averaged
        allreduce_gradients([p], group, check_every_step=False)
        y = self.x * 2.0 + self.amax[0]
        reduce_scatter_(self.shard, y, group)
        mine = self.fp8[rank * S : (rank + 1) * S]
        mine.copy_((self.shard + self.grad[0].float()).to(torch.float8_e4m3fn))
        all_gather_(self.fp8, mine, group)
        torch.add(self.fp8.float(), 1.0, out=self.out)

    def results(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.amax, self.grad, self.shard, self.fp8, self.out)]


def _replays_like_eager(rank, device):
    group, world = dist.group.WORLD, dist.get_world_size()
    eager, graphed = _Buffers(world), _Buffers(world)
    graphed.fill(0, rank)
    tape = ReplayTape()
    with torch.no_grad(), RecordingMode(tape):
        graphed.run(rank, group)
    names = tape.op_names()
    assert "c10d::_reduce_scatter_base_" in names and "c10d::_allgather_base_" in names
    assert "aten::split" not in names, "a Work's own copies were recorded"
    for seed in (1, 2):
        eager.fill(seed, rank)
        eager.run(rank, group)
        graphed.fill(seed, rank)
        with torch.no_grad():
            tape.replay()
        for i, (a, b) in enumerate(zip(graphed.results(), eager.results(), strict=True)):
            assert_bitwise_equal(a, b, f"rank {rank} seed {seed} result {i}")


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_replays_like_eager_on_the_tape(world):
    run_on_ranks("gloo", _replays_like_eager, world=world)
