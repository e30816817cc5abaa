"""torch FSDP2 layers inside make_graphed_callables (gloo ranks, the CPU replay tape): a graph pair
per fully_shard-ed layer, its forward holding the layer's all-gather (FP8 weights as FP8 bytes)
and reshard, its backward the all-gather again and the reduce-scatter into the sharded .grad; the
root (embedding, norm, gain) eager FSDP2 around them. Training equals eager FSDP2 bit for bit -
losses, local shards (FP8 bytes and scale_inv), FP8 scales and histories - with
reshard_after_forward True, False and FSDP2's defaults, delayed and current scaling, FP8 primary
weights and fp32 parameters, FSDP2's MixedPrecisionPolicy, 1, 2 and 3 ranks (uneven, padded
shards), with an evaluation (model.eval(), torch.no_grad()) between steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from tests.graphs.step_common import B, H, S, adamw, lm_loss
from tests.rank_pool import run_on_ranks
from tests.sharding.common import MB, RECIPES, batch, build_lm
from tests.sharding.test_fsdp2_graphs import _Plain, compare_local, shard_model

STEPS = 3


def _train(model, recipe, rank, device, masters, opt) -> list[torch.Tensor]:
    """The eager FSDP2 loop, the same code with the layers graphed or not."""
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
        if step == 0:  # an evaluation: the graphed layers run eagerly, with FSDP2's hooks
            model.eval()
            with torch.no_grad(), g8.fp8_autocast(recipe=recipe, fp8_group=dist.group.WORLD):
                losses.append(lm_loss(model(tokens[0]), targets[0]))
            model.train()
    return losses


def graph_layers(model, recipe, device, dtype=torch.float32):
    """make_graphed_callables of the LM's FSDP2 layers (the block, the head); dtype: that of
    their inputs (bfloat16 under MIXED: the root gathers bf16 parameters)."""
    g8.init_fsdp2(model)
    x = torch.randn(B, S, H, device=device, dtype=dtype, requires_grad=True)
    y = torch.randn(B, S, H, device=device, dtype=dtype, requires_grad=True)
    return g8.make_graphed_callables(
        (model.block, model.head), ((x,), (y,)), fp8_enabled=True, fp8_recipe=recipe,
        fp8_weight_caching=True, fp8_group=dist.group.WORLD,
    )  # fmt: skip


def _run(device, recipe, rank, reshard, fp8_weights, graphed: bool, mixed: bool = False):
    g8.reset_state()
    model = shard_model(build_lm(device, fp8_weights), reshard, mixed)
    masters = g8.MasterWeights(model) if fp8_weights else _Plain(model)
    opt = adamw(masters.parameters(), device)
    if graphed:
        graph_layers(model, recipe, device, torch.bfloat16 if mixed else torch.float32)
        ops = model.block.captured_ops()
        gathers = 0 if dist.get_world_size() == 1 else 1 + bool(reshard is not False)
        assert ops["forward"].count("c10d::_allgather_base_") == min(gathers, 1), ops
        assert ops["backward"].count("c10d::_allgather_base_") == gathers - 1 * (gathers > 0), ops
        assert ops["backward"].count("c10d::_reduce_scatter_base_") == (gathers > 0), ops
    return _train(model, recipe, rank, device, masters, opt), model


def _graphed_equals_eager(rank, device, recipe_name, reshard, fp8_weights, mixed=False):
    recipe = RECIPES[recipe_name]
    eager_losses, eager = _run(device, recipe, rank, reshard, fp8_weights, False, mixed)
    losses, graphed = _run(device, recipe, rank, reshard, fp8_weights, True, mixed)
    g8.testing.assert_bitwise_equal(torch.stack(losses), torch.stack(eager_losses), "losses")
    compare_local(eager, graphed, "after training")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_layer_graphs_equal_eager_fp8_weights(world, recipe_name, reshard):
    run_on_ranks("gloo", _graphed_equals_eager, recipe_name, reshard, True, world=world)


def test_fsdp2_layer_graphs_equal_eager_with_fsdp2_defaults():
    """fully_shard without reshard_after_forward: the layers reshard, the root keeps."""
    run_on_ranks("gloo", _graphed_equals_eager, "delayed", None, True)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_layer_graphs_equal_eager_fp32_params(reshard):
    """3 ranks: uneven shards of fp32 parameters, AdamW on the DTensors."""
    run_on_ranks("gloo", _graphed_equals_eager, "current", reshard, False, world=3)


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_fsdp2_layer_graphs_equal_eager_with_mixed_precision(fp8_weights):
    """FSDP2's MixedPrecisionPolicy (bf16 parameters gathered and inputs cast inside the layer
    graphs, fp32 gradients reduced)."""
    run_on_ranks("gloo", _graphed_equals_eager, "delayed", None, fp8_weights, True)


def test_fsdp2_layer_graphs_equal_eager_on_one_rank():
    """World size 1, what the CUDA twin runs: FSDP2 copies instead of collectives."""
    run_on_ranks("gloo", _graphed_equals_eager, "delayed", True, True, world=1)
