"""make_graphed_step(fsdp_sync="last") of an FSDP2 model (gloo ranks, the CPU replay tape):
gradient accumulation without communication inside the step graph - FSDP2's gradient sync and
reshard after backward off on every microbatch but the last, one reduce-scatter per step - equals
the eager FSDP2 step doing the same (set_requires_gradient_sync / set_reshard_after_backward
(i == last)) bit for bit: losses, clipped norms, local shards, masters, FP8 scales and histories;
2 and 3 ranks (uneven shards), reshard_after_forward True and False and FSDP2's defaults, delayed
and current scaling, FP8 weights and fp32 parameters, FSDP2's MixedPrecisionPolicy (bf16
compute, fp32 reduce: the unsharded gradients accumulated in fp32), HSDP's 2 x 2 mesh on 4 ranks
(no all-reduce across the replicas either until the last microbatch); the replay's settings check
leaves out what the graph sets itself; misuse refused before capture (the CUDA twins:
test_fsdp2_cuda.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.graphs.fsdp import set_fsdp_sync
from tests.graphs.step_common import adamw, lm_loss
from tests.rank_pool import run_on_ranks
from tests.sharding import test_fsdp2_step_graph as step_graph
from tests.sharding.common import MB, RECIPES, batch, build_lm
from tests.sharding.test_fsdp2_graphs import compare_training, shard_model


def eager_last(model, recipe, rank, device, masters, opt) -> tuple[list, list]:
    """The eager FSDP2 step with gradient accumulation without communication."""
    return step_graph.eager_steps(model, recipe, rank, device, masters, opt, sync_last=True)


def graphed_last(model, recipe, rank, device, masters, opt) -> tuple[list, list]:
    step = step_graph.graphed_step(model, recipe, device, masters, opt, fsdp_sync="last")
    ops = step.captured_ops()  # one reduce-scatter per group and step, not per microbatch
    groups = 3 if dist.get_world_size() > 1 else 0
    assert ops.count("c10d::_reduce_scatter_base_") == groups, ops
    states = [m._get_fsdp_state()._fsdp_param_group for m in (model, model.block, model.head)]
    if all(g.post_forward_mesh_info is None for g in states):  # reshard_after_forward=False
        assert ops.count("c10d::_allgather_base_") == groups, ops  # gathered once per step
    losses, norms = [], []
    for i in range(step_graph.STEPS):
        if i == 1:  # what the graph sets itself is not checked: eager would override it too
            set_fsdp_sync(model, False)
        losses.append(step(batch(i, device, rank)).clone())
        norms.append(step.grad_norm.clone())
        set_fsdp_sync(model, True)
        if masters is not None:
            masters.zero_grad()
        else:
            opt.zero_grad()
    return losses, norms


def _run(run, device, recipe, rank, reshard, fp8_weights, mixed, hsdp):
    """step_graph._run's model, with MIXED when `mixed`, on HSDP's mesh when `hsdp`."""
    g8.reset_state()
    model = shard_model(build_lm(device, fp8_weights), reshard, mixed, hsdp)
    if reshard is not None:  # applied with MIXED and on HSDP's mesh too
        states = [m._get_fsdp_state()._fsdp_param_group for m in (model, model.block, model.head)]
        assert all((g.post_forward_mesh_info is not None) == reshard for g in states), reshard
    masters = g8.MasterWeights(model) if fp8_weights else None
    opt = adamw(masters.parameters() if masters else model.parameters(), device)
    return run(model, recipe, rank, device, masters, opt), model, masters


def last_equals_eager(rank, device, recipe_name, reshard, fp8_weights, mixed=False, hsdp=False):
    recipe = RECIPES[recipe_name]
    args = (device, recipe, rank, reshard, fp8_weights, mixed, hsdp)
    eager = _run(eager_last, *args)
    compare_training(eager, _run(graphed_last, *args))
    # Every step clips (HSDP, whose 4 ranks' data average to smaller gradients: some step)
    assert (any if hsdp else all)(n > step_graph.CLIP for n in eager[0][1]), "the clip ran"


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_sync_last_step_graph_equals_eager_fp8_weights(recipe_name, reshard):
    run_on_ranks("gloo", last_equals_eager, recipe_name, reshard, True)


@pytest.mark.parametrize("recipe_name, reshard", [("delayed", True), ("current", False)],
                         ids=["delayed-reshard", "current-keep"])  # fmt: skip
def test_sync_last_step_graph_equals_eager_on_3_ranks(recipe_name, reshard):
    """Uneven, padded shards (the gain's 2 elements over 3 ranks)."""
    run_on_ranks("gloo", last_equals_eager, recipe_name, reshard, True, world=3)


def test_sync_last_step_graph_equals_eager_with_fsdp2_defaults_and_fp32_params():
    """fully_shard's defaults (the layers reshard, the root keeps), fp32 parameters, 3 ranks."""
    run_on_ranks("gloo", last_equals_eager, "delayed", None, False, world=3)


@pytest.mark.parametrize("fp8_weights, world", [(True, 2), (False, 3)],
                         ids=["fp8-weights", "fp32-params-3-ranks"])  # fmt: skip
def test_sync_last_step_graph_equals_eager_with_mixed_precision(fp8_weights, world):
    """FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 reduce, FSDP2's defaults otherwise):
    with the sync off FSDP2 keeps each microbatch's unsharded bf16 gradient as an fp32 one and
    adds the next into it (FSDPParam's to_accumulated_grad_if_needed), inside the graph too."""
    run_on_ranks("gloo", last_equals_eager, "delayed", None, fp8_weights, True, world=world)


@pytest.mark.parametrize("reshard, mixed", [(None, False), (False, False), (True, True)],
                         ids=["defaults", "keep", "reshard-mixed"])  # fmt: skip
def test_sync_last_step_graph_equals_eager_under_hsdp(reshard, mixed):
    """HSDP on 4 ranks, (2 replicas, 2 shards), each rank its own data: with the sync off FSDP2
    skips the all-reduce across the replicas too (set_requires_gradient_sync sets
    all_reduce_grads), the graph holds one per group and step; with MIXED too."""
    run_on_ranks("gloo", last_equals_eager, "delayed", reshard, True, mixed, True, world=4)


def test_sync_last_step_graph_equals_eager_on_one_rank():
    """World size 1, what the CUDA twin runs."""
    run_on_ranks("gloo", last_equals_eager, "current", True, True, world=1)


def _refusals(rank, device):
    g8.reset_state()
    model = shard_model(build_lm(device, True), False)
    masters = g8.MasterWeights(model)
    opt = adamw(masters.parameters(), device)
    kw = {"fp8_enabled": True, "master_weights": masters, "fp8_group": dist.group.WORLD}
    with pytest.raises(ValueError, match="fsdp_sync must be one of"):
        g8.make_graphed_step(model, lm_loss, opt, batch(0, device), MB, fsdp_sync="first", **kw)
    model.set_reshard_after_backward(False)
    with pytest.raises(ValueError, match=r"set_reshard_after_backward\(True\)"):
        g8.make_graphed_step(model, lm_loss, opt, batch(0, device), MB, fsdp_sync="last", **kw)
    model.set_reshard_after_backward(True)
    model.set_requires_all_reduce(False)  # HSDP's reduce-scatter without the all-reduce
    with pytest.raises(ValueError, match=r"\['all_reduce_grads'\] are off"):
        g8.make_graphed_step(model, lm_loss, opt, batch(0, device), MB, fsdp_sync="last", **kw)
    model.set_requires_all_reduce(True)
    assert all(p.grad is None for p in model.parameters())  # nothing ran


def test_sync_last_misuse_is_refused_before_capture():
    run_on_ranks("gloo", _refusals)


def test_sync_last_needs_an_fsdp2_model():
    g8.reset_state()
    model = build_lm("cpu", False)
    opt = adamw(model.parameters(), "cpu")
    with pytest.raises(ValueError, match="fsdp_sync='last' is for a model under torch FSDP2"):
        g8.make_graphed_step(model, lm_loss, opt, batch(0, "cpu"), MB, fsdp_sync="last")


def _transposes(rank, device):
    """The step graph's FP8 transposes of the gathered weights: one per weight and backward
    (its forward reads the data alone), one per weight and step when they stay gathered."""
    for reshard in (True, False):
        for sync in ("every", "last"):
            g8.reset_state()
            model = shard_model(build_lm(device, True), reshard)
            masters = g8.MasterWeights(model)
            opt = adamw(masters.parameters(), device)
            step = g8.make_graphed_step(
                model, lm_loss, opt, batch(0, device), MB, fp8_enabled=True,
                fp8_group=dist.group.WORLD, master_weights=masters, fsdp_sync=sync,
            )  # fmt: skip
            weights = sum(p.dim() == 2 and isinstance(p._local_tensor, g8.Float8Tensor)
                          for p in model.parameters())  # fmt: skip
            found = sum("fp8_transpose" in op for op in step.captured_ops())
            # reshard_after_forward=True frees them after each forward: the backward's again.
            per_weight = 1 if (sync, reshard) == ("last", False) else MB
            assert found == per_weight * weights, (reshard, sync, found, weights)


def test_gathered_fp8_weights_are_transposed_once_per_backward_or_step():
    """Failed before: the forward transposed each gathered weight too (2 * MB per weight and
    step at reshard_after_forward=True)."""
    run_on_ranks("gloo", _transposes)
