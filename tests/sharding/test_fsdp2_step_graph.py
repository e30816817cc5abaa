"""torch FSDP2 inside make_graphed_step (gloo ranks, the CPU replay tape): the whole step - every
microbatch's forward and backward with FSDP2's all-gathers and reduce-scatters, the clip by the
global norm over the shards, fused AdamW on the DTensor shards and FSDPMasterWeights' write-back
of the FP8 weights - equals the eager FSDP2 step bit for bit: losses, clipped norms, local shards
(FP8 bytes and scale_inv, fp32 parameters), masters, FP8 scales and histories; 2 and 3 ranks
(uneven, padded shards), reshard_after_forward True and False and FSDP2's defaults, delayed and
current scaling, FP8 primary weights and fp32 parameters, HSDP's 2 x 2 mesh on 4 ranks (the CUDA
twin: test_fsdp2_cuda.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from tests.graphs.step_common import adamw, lm_loss
from tests.rank_pool import run_on_ranks
from tests.sharding.common import MB, RECIPES, batch, build_lm
from tests.sharding.test_fsdp2_graphs import compare_training, shard_model

STEPS = 3
CLIP = 0.5  # small enough that every step clips


def _masters(model, fp8_weights: bool):
    return g8.MasterWeights(model) if fp8_weights else None


def eager_steps(model, recipe, rank, device, masters, opt, sync_last=False) -> tuple[list, list]:
    """The eager FSDP2 step, as make_graphed_step's docstring writes it; sync_last: with gradient
    accumulation without communication (fsdp_sync="last"). Returns (losses, norms)."""
    losses, norms = [], []
    params = list(model.parameters())
    for step in range(STEPS):
        tokens, targets = batch(step, device, rank)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for i in range(MB):
            if sync_last:
                model.set_requires_gradient_sync(i == MB - 1)
                model.set_reshard_after_backward(i == MB - 1)
            with g8.fp8_autocast(recipe=recipe, fp8_group=dist.group.WORLD):
                out = model(tokens[i], is_first_microbatch=i == 0)
            loss = lm_loss(out, targets[i]) / MB
            loss.backward()
            total += loss.detach()
        # The DDP idiom (graphfp8-train's eager step too): the model's gradient shards, the FP8
        # weights' in their nominal dtype before the masters take them in.
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).full_tensor())
        if masters is not None:
            masters.step(opt)
            masters.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
        losses.append(total)
    return losses, norms


def graphed_step(model, recipe, device, masters, opt, **options):
    """make_graphed_step of an FSDP2 LM, its sample batch step 0's (options: more of its
    keyword arguments)."""
    return g8.make_graphed_step(
        model, lm_loss, opt, batch(0, device), MB, fp8_enabled=True, fp8_recipe=recipe,
        fp8_group=dist.group.WORLD, max_grad_norm=CLIP, master_weights=masters, **options,
    )  # fmt: skip


def graphed_steps(model, recipe, rank, device, masters, opt) -> tuple[list, list]:
    step = graphed_step(model, recipe, device, masters, opt)
    ops = step.captured_ops()  # FSDP2's collectives are inside the graph, once per microbatch
    groups = 3 if dist.get_world_size() > 1 else 0
    assert ops.count("c10d::_reduce_scatter_base_") == MB * groups, ops
    losses, norms = [], []
    for i in range(STEPS):
        losses.append(step(batch(i, device, rank)).clone())
        norms.append(step.grad_norm.clone())
        if masters is not None:
            masters.zero_grad()
        else:
            opt.zero_grad()
    return losses, norms


def _run(run, device, recipe, rank, reshard, fp8_weights, hsdp=False):
    g8.reset_state()
    model = shard_model(build_lm(device, fp8_weights), reshard, hsdp=hsdp)
    masters = _masters(model, fp8_weights)
    opt = adamw(masters.parameters() if masters else model.parameters(), device)
    return run(model, recipe, rank, device, masters, opt), model, masters


def step_equals_eager(rank, device, recipe_name, reshard, fp8_weights, hsdp=False):
    recipe = RECIPES[recipe_name]
    eager = _run(eager_steps, device, recipe, rank, reshard, fp8_weights, hsdp)
    compare_training(eager, _run(graphed_steps, device, recipe, rank, reshard, fp8_weights, hsdp))
    # Every step clips (HSDP, whose 4 ranks' data average to smaller gradients: some step)
    assert (any if hsdp else all)(n > CLIP for n in eager[0][1]), "the clip ran"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_step_graph_equals_eager_fp8_weights(world, recipe_name, reshard):
    run_on_ranks("gloo", step_equals_eager, recipe_name, reshard, True, world=world)


def test_fsdp2_step_graph_equals_eager_with_fsdp2_defaults():
    """fully_shard without reshard_after_forward: the layers reshard, the root keeps."""
    run_on_ranks("gloo", step_equals_eager, "delayed", None, True, world=3)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_step_graph_equals_eager_fp32_params(reshard):
    """3 ranks: uneven shards of fp32 parameters, plain fused AdamW on the DTensors."""
    run_on_ranks("gloo", step_equals_eager, "delayed", reshard, False, world=3)


def test_fsdp2_step_graph_equals_eager_on_one_rank():
    """World size 1, what the CUDA twin runs: FSDP2 copies instead of collectives."""
    run_on_ranks("gloo", step_equals_eager, "current", True, True, world=1)


def test_fsdp2_step_graph_equals_eager_under_hsdp():
    """HSDP on 4 ranks, (2 replicas, 2 shards), each rank its own data: the step graph holds the
    reduce-scatters within a replica, the all-reduce across the replicas, the clip's norm over
    the 2-D mesh and the masters' amax all-reduce over the shard group."""
    run_on_ranks("gloo", step_equals_eager, "delayed", None, True, True, world=4)


def _no_fill(rank, device):
    g8.reset_state()
    model = shard_model(build_lm(device, True), True)
    masters = _masters(model, True)
    opt = adamw(masters.parameters(), device)
    ops = graphed_step(model, RECIPES["delayed"], device, masters, opt).captured_ops()
    # Before: a -0.0 fill (zero_, neg_) of every gradient shard, FSDP2's first reduce then added.
    assert "aten::_foreach_neg_" not in ops and "aten::_foreach_zero_" not in ops, ops
    shards = [p for p in model.parameters() if p.grad is not None]
    assert shards and all(p.grad._local_tensor._base is not None for p in shards)  # FSDP2's view


def test_fsdp2_step_graph_takes_the_gradients_fsdp2_assigns():
    """No fill, no add on the first microbatch: FSDP2's first reduce-scatter output is the
    step's static gradient."""
    run_on_ranks("gloo", _no_fill)
