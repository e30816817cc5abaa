"""torch FSDP2 inside make_graphed_microbatch (gloo ranks, the CPU replay tape): the graph holds
FSDP2's all-gathers (FP8 weights as FP8 bytes), reshards and reduce-scatters, and training with
it equals eager FSDP2 bit for bit - losses, local shards (FP8 bytes and scale_inv), FP8 scales
and histories - with reshard_after_forward True and False, delayed and current scaling, FP8
primary weights and fp32 parameters, 2 ranks and 3 (uneven, padded shards), each rank its own
data, 2 microbatches per step, FSDPMasterWeights and fused AdamW stepping between replays; and
one rank, where FSDP2 copies instead of gathering (the CUDA twins are in test_fsdp2_cuda.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw, lm_loss
from tests.modules.common import fp8_state
from tests.rank_pool import run_on_ranks
from tests.sharding.common import MB, RECIPES, batch, build_lm
from tests.sharding.test_fsdp2_reshard import shard_lm

STEPS = 3


def _eager(model, recipe, rank, device, masters, opt) -> list[torch.Tensor]:
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step, device, rank)
        for i in range(MB):
            with g8.fp8_autocast(recipe=recipe, fp8_group=dist.group.WORLD):
                out = model(tokens[i], is_first_microbatch=i == 0)
            loss = lm_loss(out, targets[i]) / MB
            loss.backward()
            losses.append(loss.detach())
        masters.step(opt)
        masters.zero_grad()
    return losses


def graphed_microbatch(model, recipe, device):
    """make_graphed_microbatch of an FSDP2 LM, its batch the first microbatch of step 0."""
    tokens, targets = batch(0, device)
    return g8.make_graphed_microbatch(
        model, lm_loss, (tokens[0], targets[0]), MB, fp8_enabled=True, fp8_recipe=recipe,
        fp8_weight_caching=True, fp8_group=dist.group.WORLD,
    )  # fmt: skip


def _graphed(model, recipe, rank, device, masters, opt) -> list[torch.Tensor]:
    graphed = graphed_microbatch(model, recipe, device)
    ops = graphed.captured_ops()  # FSDP2's collectives are inside the graph
    states = [m._get_fsdp_state()._fsdp_param_group for m in (model, model.block, model.head)]
    # Each group gathered, again in the backward after a reshard. One rank: FSDP2 copies.
    regathers = sum(g.post_forward_mesh_info is not None for g in states)
    groups = 3 if dist.get_world_size() > 1 else 0
    assert ops.count("c10d::_allgather_base_") == (groups + regathers if groups else 0), ops
    assert ops.count("c10d::_reduce_scatter_base_") == groups, ops
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step, device, rank)
        for i in range(MB):
            losses.append(graphed((tokens[i], targets[i]), is_first_microbatch=i == 0).clone())
        masters.step(opt)
        masters.zero_grad()
    return losses


class _Plain:
    """fp32 parameters: AdamW on the DTensors, zero_grad(set_to_none=False) (the replays add
    into the zeroed .grad in place, as FSDP2 accumulates into it eagerly)."""

    def __init__(self, model):
        self.params = list(model.parameters())

    def parameters(self):
        return self.params

    def step(self, opt):
        self.opt = opt
        opt.step()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=False)


# torchtitan's policy: bf16 compute (FP8 weights gathered with a bf16 nominal dtype), fp32 reduce.
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(model, reshard: bool | None, mixed: bool = False, hsdp: bool = False):
    """shard_lm's wrapping; reshard None: FSDP2's defaults (reshard_after_forward left out: True
    for the layers, False for the root), with MIXED when `mixed`, on HSDP's (2, N / 2) mesh when
    `hsdp`."""
    if reshard is not None and not (mixed or hsdp):
        return shard_lm(model, reshard)
    world, device = dist.get_world_size(), next(model.parameters()).device.type
    replicas = 2 if world % 2 == 0 else 1  # one rank (the CUDA twin): a 1 x 1 mesh
    shape = (replicas, world // replicas) if hsdp else (world,)
    mesh = init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
    kw = {"mp_policy": MIXED} if mixed else {}
    if reshard is not None:  # left out for FSDP2's defaults (the root keeps its parameters)
        kw["reshard_after_forward"] = reshard
    for layer in (model.block, model.head):
        fully_shard(layer, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _run(run, device, recipe, rank, reshard, fp8_weights, mixed=False, hsdp=False):
    g8.reset_state()
    model = shard_model(build_lm(device, fp8_weights), reshard, mixed, hsdp)
    masters = g8.MasterWeights(model) if fp8_weights else _Plain(model)
    opt = adamw(masters.parameters(), device)
    return run(model, recipe, rank, device, masters, opt), model


def compare_local(a, b, what: str) -> None:
    """Every local shard (FP8 bytes and scale_inv bit for bit), FP8 scale and amax history."""
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        la, lb = pa._local_tensor, pb._local_tensor
        if isinstance(la, g8.Float8Tensor):
            assert_bitwise_equal(lb._data.view(torch.uint8), la._data.view(torch.uint8),
                                 f"{what}: {name} data")  # fmt: skip
            assert_bitwise_equal(lb._scale_inv, la._scale_inv, f"{what}: {name} scale_inv")
        else:
            assert_bitwise_equal(lb, la, f"{what}: {name}")
    for (name, sa), (_, sb) in zip(fp8_state(a), fp8_state(b), strict=True):
        assert_bitwise_equal(sb, sa, f"{what}: {name}")


def compare_training(eager_run, graphed_run) -> None:
    """Two FSDP2 training runs, each ((losses, grad norms), model, MasterWeights or None): the
    losses, grad norms, local shards, FP8 state and fp32 masters bit for bit."""
    (want_losses, want_norms), eager, eager_masters = eager_run
    (losses, norms), graphed, masters = graphed_run
    assert_bitwise_equal(torch.stack(losses), torch.stack(want_losses), "losses")
    assert_bitwise_equal(torch.stack(norms), torch.stack(want_norms), "grad norms")
    compare_local(eager, graphed, "after training")
    if eager_masters is not None:
        for a, b in zip(eager_masters.masters, masters.masters, strict=True):
            assert_bitwise_equal(b._local_tensor, a._local_tensor, "masters")


def _graphed_equals_eager(rank, device, recipe_name, reshard, fp8_weights, mixed=False,
                          hsdp=False):  # fmt: skip
    recipe = RECIPES[recipe_name]
    eager_losses, eager = _run(_eager, device, recipe, rank, reshard, fp8_weights, mixed, hsdp)
    losses, graphed = _run(_graphed, device, recipe, rank, reshard, fp8_weights, mixed, hsdp)
    assert_bitwise_equal(torch.stack(losses), torch.stack(eager_losses), "losses")
    compare_local(eager, graphed, "after training")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_microbatch_graph_equals_eager_fp8_weights(world, recipe_name, reshard):
    run_on_ranks("gloo", _graphed_equals_eager, recipe_name, reshard, True, world=world)


def test_fsdp2_microbatch_graph_equals_eager_with_fsdp2_defaults():
    """fully_shard without reshard_after_forward: the layers reshard, the root keeps."""
    run_on_ranks("gloo", _graphed_equals_eager, "current", None, True)


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_fsdp2_microbatch_graph_equals_eager_with_mixed_precision(fp8_weights):
    """FSDP2's MixedPrecisionPolicy (bf16 parameters gathered, fp32 gradients reduced)."""
    run_on_ranks("gloo", _graphed_equals_eager, "delayed", None, fp8_weights, True)


@pytest.mark.parametrize("reshard", [None, False], ids=["defaults", "keep"])
def test_fsdp2_microbatch_graph_equals_eager_under_hsdp(reshard):
    """HSDP on 4 ranks, (2 replicas, 2 shards), each rank its own data: the graph holds the
    all-gathers and reduce-scatters within a replica and the all-reduce across the replicas."""
    run_on_ranks("gloo", _graphed_equals_eager, "delayed", reshard, True, False, True, world=4)


def test_fsdp2_microbatch_graph_equals_eager_on_one_rank():
    """World size 1, what the CUDA twin runs: FSDP2 copies instead of collectives."""
    run_on_ranks("gloo", _graphed_equals_eager, "delayed", True, True, world=1)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_microbatch_graph_equals_eager_fp32_params(reshard):
    """3 ranks: uneven shards of fp32 parameters."""
    run_on_ranks("gloo", _graphed_equals_eager, "delayed", reshard, False, world=3)
