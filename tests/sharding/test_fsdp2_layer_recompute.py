"""Activation recompute inside per-layer FSDP2 graphs (make_graphed_callables of fully_shard-ed
TransformerLayers with recompute "full" or "selective", gloo ranks, the CPU replay tape): the
recompute is captured into each layer's backward graph after its all-gather, and training equals
eager FSDP2 without recompute bit for bit - losses, local shards (FP8 bytes and scale_inv), FP8
scales and amax histories: one scale update per step and direction, each amax recorded once -
as does eager FSDP2 with the same recompute; reshard_after_forward True, False and FSDP2's
defaults, delayed and current scaling, FP8 primary weights and fp32 parameters, FSDP2's
MixedPrecisionPolicy, 1, 2 and 3 ranks (docs/sharding.md, "FSDP2 layers in
make_graphed_callables")."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw
from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES, build_lm
from tests.sharding.test_fsdp2_graphs import _Plain, compare_local, shard_model
from tests.sharding.test_fsdp2_layer_graphs import _train, graph_layers


def _gemms(ops: list[str]) -> int:
    return sum(op.startswith("aten::_scaled_mm") for op in ops)


def _run(device, recipe, rank, reshard, fp8_weights, mixed, recompute, graphed):
    """Three steps of the eager FSDP2 loop, the block recomputing as `recompute` says; with
    `graphed`, the block and the head in layer graphs. Returns (losses, model, the block's
    captured ops or None)."""
    g8.reset_state()
    lm = build_lm(device, fp8_weights)
    lm.block.recompute = recompute
    model = shard_model(lm, reshard, mixed)
    masters = g8.MasterWeights(model) if fp8_weights else _Plain(model)
    opt = adamw(masters.parameters(), device)
    ops = None
    if graphed:
        graph_layers(model, recipe, device, torch.bfloat16 if mixed else torch.float32)
        ops = model.block.captured_ops()
    return _train(model, recipe, rank, device, masters, opt), model, ops


def recompute_equals_none(rank, device, recipe_name, reshard, fp8_weights, mode, mixed=False,
                          eager=False, ops=False):  # fmt: skip
    """The layer graphs with `mode` recompute == eager FSDP2 without recompute; with `eager`, eager
    FSDP2 with it too; with `ops`, the block's backward graph holds the recompute (full: its four
    forward GEMMs again; selective: the MLP activation's cast again, no GEMM) and as many scale
    updates as without recompute."""
    recipe = RECIPES[recipe_name]
    args = (device, recipe, rank, reshard, fp8_weights, mixed)
    want, plain, _ = _run(*args, "none", False)
    for graphed in (False, True) if eager else (True,):
        what = f"{mode} recompute, {'graphed' if graphed else 'eager'}"
        losses, model, captured = _run(*args, mode, graphed)
        assert_bitwise_equal(torch.stack(losses), torch.stack(want), f"{what}: losses")
        compare_local(plain, model, what)
    if not ops:
        return
    _, _, plain_ops = _run(*args, "none", True)
    bwd, plain_bwd = captured["backward"], plain_ops["backward"]
    assert _gemms(bwd) == _gemms(plain_bwd) + 4 * (mode == "full"), bwd
    assert len(bwd) > len(plain_bwd)
    for graph in ("forward", "backward"):
        assert captured[graph].count("graphfp8::scale_update") == plain_ops[graph].count(
            "graphfp8::scale_update"
        )


@pytest.mark.parametrize("mode, recipe_name, reshard", [
    ("full", "delayed", True), ("full", "current", False),
    ("selective", "delayed", False), ("selective", "current", True),
], ids=["full-delayed-reshard", "full-current-keep", "selective-delayed-keep",
        "selective-current-reshard"])  # fmt: skip
def test_fsdp2_layer_graphs_recompute_equals_none_fp8_weights(mode, recipe_name, reshard):
    run_on_ranks("gloo", recompute_equals_none, recipe_name, reshard, True, mode)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fsdp2_layer_graphs_recompute_equals_eager_recompute(mode):
    """Eager FSDP2 with the recompute equals it too, and the backward graph holds the
    recompute."""
    run_on_ranks("gloo", recompute_equals_none, "delayed", True, True, mode, False, True,
                 True)  # fmt: skip


@pytest.mark.parametrize(
    "mode, recipe_name, reshard", [("full", "current", True), ("selective", "delayed", False)]
)
def test_fsdp2_layer_graphs_recompute_on_three_ranks(mode, recipe_name, reshard):
    """Uneven, padded shards of the FP8 weights."""
    run_on_ranks("gloo", recompute_equals_none, recipe_name, reshard, True, mode, world=3)


def test_fsdp2_layer_graphs_recompute_fp32_params():
    """3 ranks, fp32 parameters (the recompute casts them again from the re-gathered weights,
    with the forward's saved scales)."""
    run_on_ranks("gloo", recompute_equals_none, "current", True, False, "full", world=3)


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_fsdp2_layer_graphs_recompute_with_defaults_and_mixed_precision(fp8_weights):
    """FSDP2's defaults (the layers reshard after forward) under MixedPrecisionPolicy (bf16
    parameters gathered, fp32 gradients reduced)."""
    mode = "full" if fp8_weights else "selective"
    run_on_ranks("gloo", recompute_equals_none, "delayed", None, fp8_weights, mode, True)


def test_fsdp2_layer_graphs_recompute_on_one_rank():
    """World size 1, what the CUDA twin runs: FSDP2 copies instead of collectives."""
    run_on_ranks("gloo", recompute_equals_none, "delayed", True, True, "full", world=1)
