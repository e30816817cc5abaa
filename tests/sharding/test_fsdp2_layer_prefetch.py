"""FSDP2's explicit prefetch between per-layer FSDP2 graphs (gloo ranks, the CPU replay tape):
with block.set_modules_to_forward_prefetch([head]) and head.set_modules_to_backward_prefetch(
[block]), the block's forward graph holds the head's all-gather (issued before the block's
compute) and the head's forward graph only its copy-out; the head's backward graph holds the
block's all-gather again (after a reshard). Training equals eager FSDP2 with the same prefetch
bit for bit - losses, local shards (FP8 bytes and scale_inv), FP8 scales and histories -
reshard_after_forward True, False and FSDP2's defaults, delayed and current scaling, FP8 weights
and fp32 parameters, MixedPrecisionPolicy, recompute, fsdp_sync="last", 1-3 ranks; a graph whose
prefetched all-gather was not issued since its last replay, and prefetch to or from modules that
are not graphed neighbours, are refused (docs/sharding.md, "FSDP2 layers in
make_graphed_callables")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import B, H, S, adamw
from tests.rank_pool import run_on_ranks
from tests.sharding import test_fsdp2_step_graph as step_graph
from tests.sharding.common import RECIPES, build_lm
from tests.sharding.test_fsdp2_graphs import _Plain, compare_local, shard_model
from tests.sharding.test_fsdp2_layer_graphs import _train
from tests.sharding.test_fsdp2_layer_sync_last import graph_layers_last


def _prefetched(device, fp8_weights, reshard, mixed=False, recompute="none"):
    """The LM under FSDP2 with the block prefetching the head forward, the head the block
    backward."""
    lm = build_lm(device, fp8_weights)
    lm.block.recompute = recompute
    model = shard_model(lm, reshard, mixed)
    model.block.set_modules_to_forward_prefetch([model.head])
    model.head.set_modules_to_backward_prefetch([model.block])
    return model


def _run(device, recipe, rank, reshard, fp8_weights, mixed, recompute, sync, graphed):
    g8.reset_state()
    model = _prefetched(device, fp8_weights, reshard, mixed, recompute)
    masters = g8.MasterWeights(model) if fp8_weights else None
    params = masters.parameters() if masters else model.parameters()
    opt = adamw(params, device)
    if graphed:
        dtype = torch.bfloat16 if mixed else torch.float32
        graph_layers_last(model, recipe, device, dtype, sync)
        _check_ops(model, reshard)
    if sync == "last":
        return step_graph.eager_steps(model, recipe, rank, device, masters, opt, True)[0], model
    return _train(model, recipe, rank, device, masters or _Plain(model), opt), model


def _check_ops(model, reshard) -> None:
    """Where the all-gathers are: the head's forward one in the block's forward graph, the
    block's backward one (after a reshard) in the head's backward graph."""
    if dist.get_world_size() == 1:  # FSDP2 copies instead of collectives
        return
    gathers = {(m, g): ops.count("c10d::_allgather_base_")
               for m in ("block", "head")
               for g, ops in getattr(model, m).captured_ops().items()}  # fmt: skip
    again = reshard is not False  # the layers reshard after forward
    want = {("block", "forward"): 2, ("head", "forward"): 0,
            ("block", "backward"): 0, ("head", "backward"): 2 * again}  # fmt: skip
    assert {k: gathers[k] for k in want} == want, gathers


def prefetch_equals_eager(rank, device, recipe_name, reshard, fp8_weights, mixed=False,
                          recompute="none", sync="every"):  # fmt: skip
    recipe = RECIPES[recipe_name]
    args = (device, recipe, rank, reshard, fp8_weights, mixed, recompute, sync)
    want, eager = _run(*args, False)
    losses, graphed = _run(*args, True)
    assert_bitwise_equal(torch.stack(losses), torch.stack(want), "losses")
    compare_local(eager, graphed, "after training")


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_layer_graphs_prefetch_equals_eager_fp8_weights(recipe_name, reshard):
    run_on_ranks("gloo", prefetch_equals_eager, recipe_name, reshard, True)


def test_fsdp2_layer_graphs_prefetch_on_3_ranks_fp32_params():
    """Uneven, padded shards; FSDP2's defaults (the layers reshard after forward)."""
    run_on_ranks("gloo", prefetch_equals_eager, "current", None, False, world=3)


@pytest.mark.parametrize("sync", ["every", "last"])
def test_fsdp2_layer_graphs_prefetch_with_mixed_precision_and_recompute(sync):
    run_on_ranks("gloo", prefetch_equals_eager, "delayed", None, True, True, "full", sync)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_layer_graphs_prefetch_with_sync_last(reshard):
    """fsdp_sync="last": the eager loop turning FSDP2's gradient sync on for the last
    microbatch."""
    run_on_ranks("gloo", prefetch_equals_eager, "current", reshard, True, False, "none", "last")


def test_fsdp2_layer_graphs_prefetch_on_one_rank():
    """World size 1, what the CUDA twin runs."""
    run_on_ranks("gloo", prefetch_equals_eager, "delayed", True, True, world=1)


def _refused(rank, device):
    recipe = RECIPES["delayed"]
    g8.reset_state()
    model = shard_model(build_lm(device, True), True)
    model.head.set_modules_to_forward_prefetch([model.block])  # backwards, in forward
    with pytest.raises(RuntimeError, match=r"to modules other than its neighbours"):
        graph_layers_last(model, recipe, device, fsdp_sync="every")
    model.head.set_modules_to_forward_prefetch([])
    model.set_modules_to_backward_prefetch([model.head])  # the root, not graphed
    with pytest.raises(RuntimeError, match=r"a module that is not among the graphed layers"):
        graph_layers_last(model, recipe, device, fsdp_sync="every")
    model.set_modules_to_backward_prefetch([])
    assert all(p.grad is None for p in model.parameters()), "nothing ran"
    model = _prefetched(device, True, True)
    graph_layers_last(model, recipe, device, fsdp_sync="every")
    y = torch.randn(B, S, H, device=device, requires_grad=True)
    with g8.fp8_autocast(recipe=recipe, fp8_group=dist.group.WORLD):
        with pytest.raises(RuntimeError, match=r"forward graph of .* reads the all-gather that "
                           r"the forward graph of .* issues"):  # fmt: skip
            model.head(y, is_first_microbatch=True)  # the block's forward did not run first


def test_fsdp2_layer_graphs_prefetch_misuse_is_refused():
    """Prefetch out of order or from the root refused before capture; a prefetched graph
    replayed without its feeder refused before the replay."""
    run_on_ranks("gloo", _refused)
