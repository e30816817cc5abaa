"""FSDP2 on HSDP's 2-D meshes (fully_shard(model, mesh=init_device_mesh("cpu", (2, 2)))) with
graphfp8 FP8 layers and FP8 weights, on 4 gloo ranks (2 replicas x 2 shards): FP8 all-gathers
(uint8 bytes into the weight) within the shard group, gradients reduced across the replicas,
the weights' scales equal on all 4 ranks, bit for bit against 1-D FSDP2 over the shard group
(FSDPMasterWeights refused every 2-D mesh before); and the FP8 weights' scales of a step come
from one all-reduce whatever the number of layers (docs/sharding.md, "FP8 weight scales", "HSDP").

Why the reference is 1-D FSDP2 over 2 ranks and not over 4 (or DDP over 4): HSDP adds a
gradient as (a + b) + (c + d) (a reduce-scatter of 2, then an all-reduce of 2: each a sum of two,
exact in either order), while 4 ranks in one gloo ring add a + b + c + d in an order of their
own, which rounds differently. 1-D FSDP2 over the shard group computes HSDP's sums exactly: with
the replicas' data as two microbatches of the reference, ((a + b) / 2 + (c + d) / 2) / 2 (its
gradients halved before the clip: gloo has no PREMUL_SUM for FSDP2's set_gradient_divide_factor;
powers of 2 are exact), or, the same data on both replicas ((a + b) + (a + b) = 2 (a + b)), with
one microbatch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

import graphfp8 as g8
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import fp8_state
from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES

H, FFN, T = 32, 64, 16  # every shard a multiple of 16 elements at 2 shards (AdamW's vector loop)


def _layers(n: int, device) -> torch.nn.Sequential:
    """n LayerNormMLPs with FP8 primary weights, the same on every rank."""
    torch.manual_seed(0)
    with g8.fp8_model_init():
        return torch.nn.Sequential(
            *[
                g8.LayerNormMLP(H, FFN, params_dtype=torch.float32, device=device) for _ in range(n)
            ]  # fmt: skip
        )


def _shard(model: torch.nn.Sequential, mesh) -> torch.nn.Sequential:
    """fully_shard each layer, then the root, over `mesh` (FSDP2's defaults)."""
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _hsdp_mesh(device):
    """(the (replicas, shards) mesh, replicas, shards): 2 x 2 on 4 ranks, 1 x 1 on one GPU."""
    world = dist.get_world_size()
    replicas = 2 if world == 4 else 1
    mesh = init_device_mesh(device.type, (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))  # fmt: skip
    return mesh, replicas, world // replicas


def _data(step: int, shard: int, replica: int, device) -> torch.Tensor:
    seed = 100 * step + 10 * shard + replica
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(device)


def _train_step(model, masters, opt, inputs, group, recipe, grad_scale=1.0):
    """Forward and backward of each input (a microbatch), the gradients times `grad_scale`, the
    clip and the step. Returns (the summed loss, the norm)."""
    total = torch.zeros((), device=inputs[0].device)
    for x in inputs:
        with g8.fp8_autocast(recipe=recipe, fp8_group=group):
            y = model(x)
        loss = y.float().square().mean()
        loss.backward()
        total += loss.detach()
    if grad_scale != 1.0:
        torch._foreach_mul_([p.grad for p in masters.parameters()], grad_scale)
    norm = masters.clip_grad_norm_(1e-3)  # below every norm here: it clips
    masters.step(opt)
    masters.zero_grad()
    return total, norm


def _compare_shards(hsdp, ref, what: str, fp8_state_too: bool) -> None:
    """Every local shard (FP8 data and scale_inv), and the FP8 state if asked, bit for bit."""
    for (name, p), (_, q) in zip(hsdp.named_parameters(), ref.named_parameters(), strict=True):
        a, b = p._local_tensor, q._local_tensor
        if isinstance(a, Float8Tensor):
            assert_bitwise_equal(a._data.view(torch.uint8), b._data.view(torch.uint8),
                                 f"{what}: {name} data")  # fmt: skip
            assert_bitwise_equal(a._scale_inv, b._scale_inv, f"{what}: {name} scale_inv")
        else:
            assert_bitwise_equal(a, b, f"{what}: {name}")
    if not fp8_state_too:
        return
    for (name, sa), (_, sb) in zip(fp8_state(hsdp), fp8_state(ref), strict=True):
        assert_bitwise_equal(sa, sb, f"{what}: {name}")


def _same_on_every_replica(model, shards: int, what: str) -> None:
    """Each rank's shards and scale_inv against every rank's that holds the same shard index,
    and every FP8 weight's scale_inv against all 4 ranks'."""
    mine = [p._local_tensor for p in model.parameters()]
    digest = [(t._data.view(torch.uint8).clone(), t._scale_inv.clone())
              if isinstance(t, Float8Tensor) else (t.detach().clone(), None)
              for t in mine]  # fmt: skip
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dist.get_rank() % shards, digest))
    for other_shard, theirs in every:
        for (name, _), (data, scale_inv), (other_data, other_scale_inv) in zip(
            model.named_parameters(), digest, theirs, strict=True
        ):
            if scale_inv is not None:
                assert_bitwise_equal(scale_inv, other_scale_inv, f"{what}: {name} scale_inv")
            if other_shard == dist.get_rank() % shards:
                assert_bitwise_equal(data, other_data, f"{what}: {name}")


def _hsdp_equals_fsdp_over_the_shard_group(rank, device, recipe_name, replicas_differ):
    mesh, replicas, shards = _hsdp_mesh(device)
    replica, shard = rank // shards, rank % shards
    hsdp = _shard(_layers(2, device), mesh)
    ref = _shard(_layers(2, device), mesh["shard"])
    runs = {}
    for key, model in (("hsdp", hsdp), ("ref", ref)):
        masters = g8.MasterWeights(model)
        opt = torch.optim.AdamW(masters.parameters(), lr=1e-2, fused=True)
        runs[key] = (model, masters, opt)
    shard_ranks = dist.get_process_group_ranks(runs["hsdp"][1].group)
    assert shard_ranks == [replica * shards + s for s in range(shards)], shard_ranks
    recipe = RECIPES[recipe_name]
    for step in range(3):
        if replicas_differ:
            mine = [_data(step, shard, replica, device)]
            both = [_data(step, shard, r, device) for r in range(replicas)]
        else:
            mine = both = [_data(step, shard, 0, device)]
        loss, norm = _train_step(*runs["hsdp"], mine, dist.group.WORLD, recipe)
        ref_loss, ref_norm = _train_step(
            *runs["ref"], both, mesh["shard"].get_group(), recipe, grad_scale=1 / len(both)
        )
        if not replicas_differ:
            assert_bitwise_equal(loss, ref_loss, f"step {step}: loss")
        assert_bitwise_equal(norm, ref_norm, f"step {step}: the clipped norm")
        # Each rank's own data: current scaling's state holds its last cast's scale (this
        # rank's data against the reference's second microbatch), so only the weights compare.
        _compare_shards(hsdp, ref, f"step {step}", fp8_state_too=not replicas_differ)
        for m_hsdp, m_ref in zip(runs["hsdp"][1].masters, runs["ref"][1].masters, strict=True):
            assert_bitwise_equal(m_hsdp._local_tensor, m_ref._local_tensor, f"step {step} master")
        _same_on_every_replica(hsdp, shards, f"step {step}")


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_hsdp_with_the_same_data_on_the_replicas_equals_fsdp_over_the_shard_group(recipe_name):
    """Delayed scaling too: the amaxes MAX-reduced over all 4 ranks equal those over the shard
    group when the replicas see the same data."""
    run_on_ranks("gloo", _hsdp_equals_fsdp_over_the_shard_group, recipe_name, False, world=4)


def test_hsdp_reduces_the_gradients_across_the_replicas():
    """Each rank its own data: the reference sees both replicas' data as two microbatches
    (current scaling: a cast's scale is its own tensor's, as on the HSDP rank that holds it)."""
    run_on_ranks("gloo", _hsdp_equals_fsdp_over_the_shard_group, "current", True, world=4)


def _all_reduces_per_step(rank, device, layers, hsdp, recipe_name) -> None:
    world = dist.get_world_size()
    mesh = _hsdp_mesh(device)[0] if hsdp else init_device_mesh(device.type, (world,))
    model = _shard(_layers(layers, device), mesh)
    masters = g8.MasterWeights(model)
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-2, fused=True)
    recipe = RECIPES[recipe_name]
    for step in range(2):
        counts = {}
        for phase in ("forward", "backward", "clip", "step"):
            with CommDebugMode() as comms:
                if phase == "forward":
                    with g8.fp8_autocast(recipe=recipe, fp8_group=dist.group.WORLD):
                        y = model(_data(step, rank, 0, device))
                elif phase == "backward":
                    y.float().square().mean().backward()
                elif phase == "clip":
                    masters.clip_grad_norm_(1.0)
                else:
                    masters.step(opt)
                    masters.zero_grad()
            counts[phase] = {str(k).split(".")[-1]: v for k, v in comms.get_comm_counts().items()}
        # One MAX all-reduce of the (W,) amaxes gives every FP8 weight's scale: 2 per layer here.
        assert counts["step"] == {"allreduce_": 1}, counts
        if dist.get_world_size() == 1:  # whether FSDP2 communicates at world size 1 is its own
            continue
        # The amaxes of the activations: one all-reduce per pass under delayed scaling, none
        # under current; HSDP's backward all-reduces each layer's gradients across the replicas.
        per_pass = 1 if recipe_name == "delayed" else 0
        assert counts["forward"].get("allreduce_", 0) == per_pass, counts
        grads = layers if hsdp else 0
        assert counts["backward"].get("allreduce_", 0) == per_pass + grads, counts
        assert counts["forward"]["_allgather_base_"] == layers, counts  # one FP8 gather a layer


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("layers", [1, 4])
def test_fp8_weight_scales_take_one_all_reduce_per_step(layers, recipe_name):
    """2 ranks, 1-D mesh: the step's collectives do not grow with the layers (torchao's
    precompute_float8_dynamic_scale_for_fsdp, done by masters.step)."""
    run_on_ranks("gloo", _all_reduces_per_step, layers, False, recipe_name)


def test_fp8_weight_scales_take_one_all_reduce_per_step_under_hsdp():
    run_on_ranks("gloo", _all_reduces_per_step, 2, True, "delayed", world=4)


def _hsdp_gathers_fp8_bytes_within_the_shard_group(rank, device):
    mesh, _, shards = _hsdp_mesh(device)
    model = _shard(_layers(1, device), mesh)
    layer = model[0]
    group = layer._get_fsdp_state()._fsdp_param_group
    ranks = dist.get_process_group_ranks(group.mesh_info.shard_process_group)
    assert ranks == dist.get_process_group_ranks(mesh["shard"].get_group()), ranks
    layer.unshard()
    gathered = 0
    for param in group.fsdp_params:
        if not isinstance(param.sharded_param._local_tensor, Float8Tensor):
            continue
        out = param.all_gather_outputs[0]
        weight = getattr(layer, param._module_info.param_name)
        assert out.dtype == torch.uint8 and out.numel() == weight.numel()  # the whole weight
        assert weight._data.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        local = param.sharded_param._local_tensor._data.view(torch.uint8)
        rows = local.shape[0]
        mine = weight._data.view(torch.uint8)[rank % shards * rows : (rank % shards + 1) * rows]
        assert_bitwise_equal(mine, local, f"{param._module_info.param_name}: this rank's rows")
        gathered += 1
    layer.reshard()
    assert gathered == 2


def test_hsdp_all_gathers_fp8_bytes_within_the_shard_group():
    run_on_ranks("gloo", _hsdp_gathers_fp8_bytes_within_the_shard_group, world=4)


def _mixed_meshes_refused(rank, device):
    model = _layers(2, device)
    fully_shard(model[0], mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    fully_shard(model[1], mesh=_hsdp_mesh(device)[0])
    before = [p._local_tensor._data.clone() for p in model.parameters()
              if isinstance(p._local_tensor, Float8Tensor)]  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"one device mesh, 1-D .* or HSDP's 2-D .* found "
        r"1-D mesh \(Shard\(dim=0\),\), 2-D mesh \(Replicate\(\), Shard\(dim=0\)\)",
    ):
        g8.MasterWeights(model)
    after = [p._local_tensor._data for p in model.parameters()
             if isinstance(p._local_tensor, Float8Tensor)]  # fmt: skip
    for a, b in zip(before, after, strict=True):
        assert_bitwise_equal(a.view(torch.uint8), b.view(torch.uint8), "untouched")


def test_fp8_weights_on_two_meshes_are_refused():
    """Layers sharded over different meshes: their amaxes have no one group; refused naming
    what is taken, before anything changes."""
    run_on_ranks("gloo", _mixed_meshes_refused, world=4)
