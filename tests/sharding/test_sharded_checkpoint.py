"""Checkpoints of sharded masters (2 gloo ranks): each rank's state_dict resumes bit for bit on
the same N; a shard of another N or layout raises on every rank, naming both, before anything
loads; full_state_dict() on rank 0 loads into an unsharded MasterWeights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES, Sharded, batch, build_lm, compare_models

RECIPE = RECIPES["delayed"]


def _state(run: Sharded) -> dict:
    return {"model": run.model.state_dict(), "masters": run.masters.state_dict(),
            "optimizer": run.opt.state_dict()}  # fmt: skip


def _resume(run: Sharded, state: dict) -> None:
    run.model.load_state_dict(state["model"])
    run.masters.load_state_dict(state["masters"])
    run.opt.load_state_dict(state["optimizer"])


def _save_and_resume(rank, device, tmp):
    group = dist.group.WORLD
    run = Sharded(build_lm(device), device, group)
    for s in range(2):
        run.step(batch(s, device, rank), RECIPE)
    path = f"{tmp}/rank{rank}.pt"
    torch.save(_state(run), path)
    for s in range(2, 4):
        run.step(batch(s, device, rank), RECIPE)
    torch.manual_seed(5)  # another start: everything must come from the checkpoint
    resumed = Sharded(build_lm(device), device, group)
    _resume(resumed, torch.load(path))
    for s in range(2, 4):
        resumed.step(batch(s, device, rank), RECIPE)
    compare_models(resumed.model, run.model, f"rank {rank} resumed")
    for i, (a, b) in enumerate(zip(resumed.masters.master_shards, run.masters.master_shards,
                                   strict=True)):  # fmt: skip
        assert_bitwise_equal(a, b, f"rank {rank}: master slice {i}")


def _other_layouts_raise(rank, device):
    group = dist.group.WORLD
    alone, _ = dist.new_subgroups(group_size=1)
    one = Sharded(build_lm(device), device, group, shard_group=alone, independent_groups=True)
    run = Sharded(build_lm(device), device, group)
    run.step(batch(0, device, rank), RECIPE)
    before = [m.clone() for m in run.masters.master_shards]
    with pytest.raises(ValueError, match=r"nothing was loaded: rank 0: .*rank 0 of 1 .* this run "
                                         r"is rank 0 of 2 .*; rank 1: .*rank 0 of 1"):  # fmt: skip
        run.masters.load_state_dict(one.masters.state_dict())
    other_rank = [None, None]
    dist.all_gather_object(other_rank, run.masters.state_dict())
    swapped = r"rank 0: .* rank 1 of 2 .* this run is rank 0 of 2 .*: rank 1 vs 0"
    with pytest.raises(ValueError, match=swapped):
        run.masters.load_state_dict(other_rank[1 - rank])
    with pytest.raises(ValueError, match="full_state_dict"):
        run.masters.load_state_dict({"masters": {}})
    for a, b in zip(run.masters.master_shards, before, strict=True):
        assert_bitwise_equal(a, b, "nothing loaded")
    full = run.masters.full_state_dict()
    assert (full is None) == (rank != 0)
    if full is not None:  # consolidated: an unsharded MasterWeights trains on from it
        plain = build_lm(device)
        unsharded = g8.MasterWeights(plain)
        unsharded.load_state_dict(full)
        for name, p in plain.named_parameters():
            q = dict(run.model.named_parameters())[name]
            if name in full["masters"]:
                assert_bitwise_equal(p._data.view(torch.uint8), q._data.view(torch.uint8), name)
            else:
                assert_bitwise_equal(full["hp_masters"][name], q.detach(), name)


def test_save_and_resume_bit_for_bit(tmp_path):
    run_on_ranks("gloo", _save_and_resume, str(tmp_path))


def test_another_layout_raises_naming_both_and_full_state_exports():
    run_on_ranks("gloo", _other_layouts_raise)
