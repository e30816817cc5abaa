"""Checkpoints across world sizes through torch.distributed.checkpoint (training/dcp_checkpoint.py,
gloo): an FSDP2 model with FP8 weights and its FSDPMasterWeights, and a replicated model with
sharded masters, each with its AdamW, saved at 2 ranks, loaded at 3 (uneven shards) into a fresh
model that never ran a forward, saved there, loaded at 2 again: the state at 3 is the state saved
at 2, and training on at 2 equals the run that never stopped, bit for bit. (Training at 3 is not
compared: 3 ranks split and average the data otherwise.) Ranks whose FP8 amaxes are their own (no
fp8_group) are refused: a checkpoint for any world size keeps one FP8 state. HSDP (a 2 x 2 mesh
on 4 ranks) saves a checkpoint that 1-D FSDP2 loads at 3, and loads it back at 4 and trains on
equal to the HSDP run that never stopped."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import graphfp8 as g8
from graphfp8.distributed.sharded_masters import ShardedMasterWeights
from graphfp8.testing import assert_bitwise_equal
from graphfp8.training import dcp_checkpoint
from tests.graphs.step_common import adamw, lm_loss
from tests.modules.common import fp8_state
from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES, batch, build_lm
from tests.sharding.test_fsdp2_reshard import shard_lm

RECIPE = RECIPES["delayed"]


def _setup(kind: str, device):
    """(model, masters, optimizer) of a fresh model, never run."""
    if kind == "fsdp":
        model = shard_lm(build_lm(device), reshard=True)
        masters = g8.MasterWeights(model)
    elif kind == "hsdp":
        model = build_lm(device)
        mesh = init_device_mesh(device.type, (2, dist.get_world_size() // 2),
                                mesh_dim_names=("replicate", "shard"))  # fmt: skip
        for part in (model.block, model.head, model):
            fully_shard(part, mesh=mesh)
        masters = g8.MasterWeights(model)
    else:
        model = build_lm(device)
        masters = g8.MasterWeights(model, shard_group=dist.group.WORLD)
    return model, masters, adamw(masters.parameters(), device)


def _train(model, masters, opt, rank: int, steps: range) -> None:
    for step in steps:
        tokens, targets = batch(step, next(model.parameters()).device, rank)
        for i in range(tokens.shape[0]):
            with g8.fp8_autocast(recipe=RECIPE, fp8_group=dist.group.WORLD):
                out = model(tokens[i], is_first_microbatch=i == 0)
            (lm_loss(out, targets[i]) / tokens.shape[0]).backward()
        masters.step(opt)
        masters.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.dequantize() if isinstance(t, g8.Float8Tensor) else t.clone()


def _whole_state(model, masters) -> dict:
    """The model's parameters (dequantized: the same FP8 bits and scale give the same values),
    its FP8 state and the masters, whole, on every rank (a collective)."""
    state = {f"param {n}": _full(p.detach()) for n, p in model.named_parameters()}
    state.update({f"fp8 {n}": t.clone() for n, t in fp8_state(model)})
    if isinstance(masters, ShardedMasterWeights):
        full = masters.full_state_dict()
        objects = [full]
        dist.broadcast_object_list(objects, src=0)
        full = objects[0]
        state.update({f"master {n}": t for n, t in {**full["masters"],
                                                    **full["hp_masters"]}.items()})  # fmt: skip
    else:
        state.update({f"master {n}": _full(m.detach()) for n, m in
                      zip(masters.names, masters.masters, strict=True)})  # fmt: skip
    return state


def _compare(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key in want:
        assert_bitwise_equal(got[key], want[key], f"{what}: {key}")


def _at_2_first(rank, device, kind, root):
    """Trains 2 steps, saves A and its whole state (the same on every rank: save reduced the
    amaxes), trains 2 more: the run that never stops."""
    model, masters, opt = _setup(kind, device)
    _train(model, masters, opt, rank, range(2))
    with pytest.raises(ValueError, match=r"fp8_autocast\(fp8_group=...\)"):
        dcp_checkpoint.save(f"{root}/refused", model, masters, opt, fp8_group=None)
    dcp_checkpoint.save(f"{root}/a", model, masters, opt, fp8_group=dist.group.WORLD)
    saved = _whole_state(model, masters)
    _train(model, masters, opt, rank, range(2, 4))
    final = _whole_state(model, masters)  # the amaxes since the last update: this rank's own
    torch.save({"a": saved, "final": final}, f"{root}/states.{rank}.pt")


def _at_3(rank, device, kind, root):
    model, masters, opt = _setup(kind, device)
    assert not opt.state and all(getattr(m, "fp8_meta", None) is None for m in model.modules())
    dcp_checkpoint.load(f"{root}/a", model, masters, opt, RECIPE)
    saved = torch.load(f"{root}/states.0.pt", map_location=device)["a"]
    _compare(_whole_state(model, masters), saved, "loaded at 3")
    dcp_checkpoint.save(f"{root}/b", model, masters, opt, fp8_group=dist.group.WORLD)


def _at_2_again(rank, device, kind, root):
    model, masters, opt = _setup(kind, device)
    dcp_checkpoint.load(f"{root}/b", model, masters, opt, RECIPE)
    _train(model, masters, opt, rank, range(2, 4))
    final = torch.load(f"{root}/states.{rank}.pt", map_location=device)["final"]
    _compare(_whole_state(model, masters), final, "resumed")


@pytest.mark.parametrize("kind", ["fsdp", "sharded"], ids=["fsdp2", "sharded-masters"])
def test_checkpoint_moves_2_to_3_to_2(kind, tmp_path):
    run_on_ranks("gloo", _at_2_first, kind, str(tmp_path))
    run_on_ranks("gloo", _at_3, kind, str(tmp_path), world=3)
    run_on_ranks("gloo", _at_2_again, kind, str(tmp_path))


def test_hsdp_checkpoint_moves_to_1d_fsdp2_and_back(tmp_path):
    """Saved by HSDP (2 replicas of 2 shards), loaded by 1-D FSDP2 at 3 ranks (the replicas'
    copies are one tensor to DCP), saved there and loaded by HSDP again."""
    run_on_ranks("gloo", _at_2_first, "hsdp", str(tmp_path), world=4)
    run_on_ranks("gloo", _at_3, "fsdp", str(tmp_path), world=3)
    run_on_ranks("gloo", _at_2_again, "hsdp", str(tmp_path), world=4)
