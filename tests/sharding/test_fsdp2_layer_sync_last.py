"""make_graphed_callables(..., fsdp_sync="last") of FSDP2 layers (gloo ranks, the CPU replay
tape): gradient accumulation without communication in per-layer graphs - each layer's backward
graph adds its unsharded gradients into sums and holds no reduce-scatter, its sync graph
reduce-scatters them after the backward run with FSDP2's gradient sync on - equals the eager
FSDP2 step doing the same (set_requires_gradient_sync / set_reshard_after_backward(i == last))
bit for bit: losses, clipped norms, local shards, masters, FP8 scales and histories; 2 and 3
ranks (uneven shards), reshard_after_forward True and False and FSDP2's defaults, delayed and
current scaling, FP8 weights and fp32 parameters, FSDP2's MixedPrecisionPolicy (the bf16
unsharded gradients summed in fp32), a step with the sync on every microbatch, and activation
recompute; misuse refused (docs/sharding.md, "FSDP2 layers in make_graphed_callables")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import B, H, S, adamw
from tests.rank_pool import run_on_ranks
from tests.sharding import test_fsdp2_layer_graphs as layer_graphs
from tests.sharding import test_fsdp2_step_graph as step_graph
from tests.sharding.common import RECIPES, build_lm
from tests.sharding.test_fsdp2_graphs import compare_local, compare_training, shard_model


def graph_layers_last(model, recipe, device, dtype=torch.float32, fsdp_sync="last"):
    """make_graphed_callables of the LM's FSDP2 layers (the block, the head) with `fsdp_sync`."""
    g8.init_fsdp2(model)
    x = torch.randn(B, S, H, device=device, dtype=dtype, requires_grad=True)
    y = torch.randn(B, S, H, device=device, dtype=dtype, requires_grad=True)
    return g8.make_graphed_callables(
        (model.block, model.head), ((x,), (y,)), fp8_enabled=True, fp8_recipe=recipe,
        fp8_weight_caching=True, fp8_group=dist.group.WORLD, fsdp_sync=fsdp_sync,
    )  # fmt: skip


def _run(device, recipe, rank, reshard, fp8_weights, mixed, graphed, recompute):
    """step_graph.eager_steps(sync_last=True) of the LM, its layers graphed or not."""
    g8.reset_state()
    lm = build_lm(device, fp8_weights)
    lm.block.recompute = recompute
    model = shard_model(lm, reshard, mixed)
    masters = g8.MasterWeights(model) if fp8_weights else None
    opt = adamw(masters.parameters() if masters else model.parameters(), device)
    if graphed:
        graph_layers_last(model, recipe, device, torch.bfloat16 if mixed else torch.float32)
        ops = model.block.captured_ops()
        one = dist.get_world_size() > 1  # one rank: FSDP2 copies instead of collectives
        assert ops["backward"].count("c10d::_reduce_scatter_base_") == 0, ops["backward"]
        assert ops["sync"].count("c10d::_reduce_scatter_base_") == one, ops["sync"]
    run = step_graph.eager_steps(model, recipe, rank, device, masters, opt, sync_last=True)
    return run, model, masters


def last_equals_eager(rank, device, recipe_name, reshard, fp8_weights, mixed=False,
                      recompute="none"):  # fmt: skip
    recipe = RECIPES[recipe_name]
    args = (device, recipe, rank, reshard, fp8_weights, mixed)
    compare_training(_run(*args, False, "none"), _run(*args, True, recompute))


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_layer_graphs_sync_last_equals_eager_fp8_weights(recipe_name, reshard):
    run_on_ranks("gloo", last_equals_eager, recipe_name, reshard, True)


@pytest.mark.parametrize("recipe_name, reshard", [("delayed", True), ("current", False)],
                         ids=["delayed-reshard", "current-keep"])  # fmt: skip
def test_fsdp2_layer_graphs_sync_last_on_3_ranks(recipe_name, reshard):
    """Uneven, padded shards."""
    run_on_ranks("gloo", last_equals_eager, recipe_name, reshard, True, world=3)


def test_fsdp2_layer_graphs_sync_last_fsdp2_defaults_fp32_params():
    """fully_shard's defaults (the layers reshard, the root keeps), fp32 parameters, 3 ranks."""
    run_on_ranks("gloo", last_equals_eager, "delayed", None, False, world=3)


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_fsdp2_layer_graphs_sync_last_with_mixed_precision(fp8_weights):
    """MixedPrecisionPolicy: the bf16 unsharded gradients summed in fp32 inside the backward
    graphs, as FSDP2's to_accumulated_grad_if_needed does eagerly."""
    run_on_ranks("gloo", last_equals_eager, "delayed", None, fp8_weights, True)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fsdp2_layer_graphs_sync_last_with_recompute(mode):
    """Recompute and sync-last together, against eager without recompute."""
    run_on_ranks("gloo", last_equals_eager, "current", True, True, False, mode)


def test_fsdp2_layer_graphs_sync_last_on_one_rank():
    """World size 1, what the CUDA twin runs."""
    run_on_ranks("gloo", last_equals_eager, "delayed", True, True, world=1)


def _sync_every(rank, device):
    """Captured with fsdp_sync="last", the loop leaving the sync on (every microbatch reduces,
    each sum holding one microbatch's gradient), an evaluation between steps: equal to eager
    FSDP2's default loop."""
    recipe = RECIPES["current"]
    runs = []
    for graphed in (False, True):
        g8.reset_state()
        model = shard_model(build_lm(device, True), True)
        masters = g8.MasterWeights(model)
        opt = adamw(masters.parameters(), device)
        if graphed:
            graph_layers_last(model, recipe, device)
        runs.append((layer_graphs._train(model, recipe, rank, device, masters, opt), model))
    assert_bitwise_equal(torch.stack(runs[1][0]), torch.stack(runs[0][0]), "losses")
    compare_local(runs[0][1], runs[1][1], "after training")


def test_fsdp2_layer_graphs_sync_last_capture_with_the_sync_on_every_microbatch():
    run_on_ranks("gloo", _sync_every)


def _refused(rank, device):
    g8.reset_state()
    model = shard_model(build_lm(device, True), True)
    with pytest.raises(ValueError, match="fsdp_sync must be one of"):
        graph_layers_last(model, RECIPES["delayed"], device, fsdp_sync="first")
    graph_layers_last(model, RECIPES["delayed"], device)
    x = torch.randn(B, S, H, device=device, requires_grad=True)
    before = [p._local_tensor._data.clone() for p in model.block.parameters() if p.dim() == 2]
    model.set_requires_gradient_sync(False)  # the settings the graphs' eager loop sets: accepted
    model.set_reshard_after_backward(False)
    with g8.fp8_autocast(recipe=RECIPES["delayed"], fp8_group=dist.group.WORLD):
        out = model.block(x, is_first_microbatch=True)
    with pytest.raises(RuntimeError, match="captured with fsdp_sync='last'.*backward.inputs"):
        torch.autograd.grad(out.float().sum(), x)
    after = [p._local_tensor._data for p in model.block.parameters() if p.dim() == 2]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_fsdp2_layer_graphs_sync_last_misuse_is_refused():
    """An unknown fsdp_sync; a backward that leaves the parameters out (its gradients would be
    added into the sums), refused before the replay."""
    run_on_ranks("gloo", _refused)


def test_fsdp2_layer_graphs_sync_last_needs_fsdp2_layers():
    g8.reset_state()
    model = build_lm("cpu", False)
    x = torch.randn(B, S, H, requires_grad=True)
    with pytest.raises(ValueError, match="fsdp_sync='last' is for fully_shard-ed layers"):
        g8.make_graphed_callables(model.block, (x,), fsdp_sync="last")
