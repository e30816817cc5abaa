"""FSDP2 with FP8 weights on GPUs (NCCL, tests/rank_pool.py, one GPU per rank): the default
reshard_after_forward=True equals False bit for bit (the NaN of issue 40 on the GPU: the
re-gathered weight's transpose rebuilt by the backward), on one GPU and on 2 and 3 where the
machine has them; a DCP checkpoint saved at 2 GPUs loads at 3 (skipped with fewer); clipping
masters.parameters() equals clipping model.parameters() on one GPU; HSDP's 2-D mesh equals 1-D
FSDP2 over its shard group (1 x 1 on one GPU, 2 x 2 on 4) and the FP8 weights' scales take one
all-reduce per step (tests/sharding/test_fsdp2_hsdp.py); make_graphed_microbatch of the FSDP2
model (a CUDA graph holding FSDP2's forward and backward) and make_graphed_step of it (the whole
step: FSDP2's collectives, the clip, capturable AdamW on the shards, the FP8 write-back) equal
eager FSDP2 on one GPU, with fsdp_sync="last" too (one reduce-scatter per step, the unsharded
gradients accumulated inside the CUDA graph, in fp32 under FSDP2's MixedPrecisionPolicy, and
on HSDP's 1 x 1 mesh: tests/sharding/test_fsdp2_sync_last.py), whose
gathered FP8 weights are transposed once per backward (once per step when kept gathered), and so
do make_graphed_callables of its FSDP2 layers (a CUDA graph pair per layer,
tests/sharding/test_fsdp2_layer_graphs.py), with activation recompute inside them too
(tests/sharding/test_fsdp2_layer_recompute.py) and with fsdp_sync="last" (each layer's sync
graph reduce-scatters the unsharded sums: tests/sharding/test_fsdp2_layer_sync_last.py) and
with FSDP2's explicit prefetch (a layer's graph issuing the next layer's all-gather, its side
streams joined at the graph's end: tests/sharding/test_fsdp2_layer_prefetch.py)."""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import run_on_ranks
from tests.sharding.test_dcp_world_sizes import _at_2_again, _at_2_first, _at_3
from tests.sharding.test_fsdp2_clip import _idioms_agree
from tests.sharding.test_fsdp2_graphs import _graphed_equals_eager
from tests.sharding.test_fsdp2_hsdp import (
    _all_reduces_per_step,
    _hsdp_equals_fsdp_over_the_shard_group,
)
from tests.sharding.test_fsdp2_layer_graphs import _graphed_equals_eager as _layers_equal_eager
from tests.sharding.test_fsdp2_layer_prefetch import prefetch_equals_eager
from tests.sharding.test_fsdp2_layer_recompute import recompute_equals_none
from tests.sharding.test_fsdp2_layer_sync_last import last_equals_eager as _layers_last_equal
from tests.sharding.test_fsdp2_reshard import _reshard_equals_no_reshard
from tests.sharding.test_fsdp2_step_graph import step_equals_eager
from tests.sharding.test_fsdp2_sync_last import _transposes, last_equals_eager

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_reshard_after_forward_on_one_gpu(recipe_name):
    run_on_ranks("nccl", _reshard_equals_no_reshard, recipe_name, world=1)


@pytest.mark.skipif(GPUS < 3, reason="needs 3 GPUs")
@pytest.mark.parametrize("world", [2, 3])
def test_reshard_after_forward_on_several_gpus(world):
    run_on_ranks("nccl", _reshard_equals_no_reshard, "delayed", world=world)


@pytest.mark.skipif(GPUS < 3, reason="needs 3 GPUs")
@pytest.mark.parametrize("kind", ["fsdp", "sharded"])
def test_dcp_checkpoint_moves_2_to_3_to_2_gpus(kind, tmp_path):
    run_on_ranks("nccl", _at_2_first, kind, str(tmp_path))
    run_on_ranks("nccl", _at_3, kind, str(tmp_path), world=3)
    run_on_ranks("nccl", _at_2_again, kind, str(tmp_path))


def test_clipping_the_masters_equals_clipping_the_model_on_one_gpu():
    run_on_ranks("nccl", _idioms_agree, world=1)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_hsdp_equals_fsdp_over_the_shard_group_on_one_gpu(recipe_name):
    run_on_ranks("nccl", _hsdp_equals_fsdp_over_the_shard_group, recipe_name, False, world=1)


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("replicas_differ", [False, True])
def test_hsdp_on_four_gpus(replicas_differ):
    recipe_name = "current" if replicas_differ else "delayed"
    run_on_ranks("nccl", _hsdp_equals_fsdp_over_the_shard_group, recipe_name, replicas_differ,
                 world=4)  # fmt: skip


@pytest.mark.parametrize("hsdp", [False, True], ids=["1-D", "hsdp"])
def test_fp8_weight_scales_take_one_all_reduce_per_step_on_one_gpu(hsdp):
    run_on_ranks("nccl", _all_reduces_per_step, 4, hsdp, "delayed", world=1)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_microbatch_graph_equals_eager_on_one_gpu(recipe_name, reshard):
    run_on_ranks("nccl", _graphed_equals_eager, recipe_name, reshard, True, world=1)


def test_fsdp2_microbatch_graph_fp32_params_on_one_gpu():
    run_on_ranks("nccl", _graphed_equals_eager, "delayed", True, False, world=1)


@pytest.mark.parametrize("mixed, hsdp", [(True, False), (False, True)], ids=["mixed", "hsdp"])
def test_fsdp2_microbatch_graph_mixed_precision_and_hsdp_on_one_gpu(mixed, hsdp):
    run_on_ranks("nccl", _graphed_equals_eager, "delayed", None, True, mixed, hsdp, world=1)


@pytest.mark.skipif(GPUS < 3, reason="needs 3 GPUs")
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_microbatch_graph_on_several_gpus(world):
    run_on_ranks("nccl", _graphed_equals_eager, "delayed", True, True, world=world)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_step_graph_equals_eager_on_one_gpu(recipe_name, reshard):
    run_on_ranks("nccl", step_equals_eager, recipe_name, reshard, True, world=1)


def test_fsdp2_step_graph_fp32_params_on_one_gpu():
    run_on_ranks("nccl", step_equals_eager, "delayed", None, False, world=1)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False, None], ids=["reshard", "keep", "defaults"])
def test_fsdp2_sync_last_step_graph_equals_eager_on_one_gpu(recipe_name, reshard):
    run_on_ranks("nccl", last_equals_eager, recipe_name, reshard, True, world=1)


def test_fsdp2_sync_last_step_graph_fp32_params_on_one_gpu():
    run_on_ranks("nccl", last_equals_eager, "delayed", False, False, world=1)


@pytest.mark.parametrize("mixed, hsdp", [(True, False), (False, True), (True, True)],
                         ids=["mixed", "hsdp", "mixed-hsdp"])  # fmt: skip
def test_fsdp2_sync_last_step_graph_mixed_precision_and_hsdp_on_one_gpu(mixed, hsdp):
    """The fp32 accumulation of the bf16 unsharded gradients inside the CUDA graph; HSDP's
    1 x 1 mesh."""
    run_on_ranks("nccl", last_equals_eager, "delayed", None, True, mixed, hsdp, world=1)


def test_fsdp2_gathered_fp8_weights_transposed_once_per_backward_on_one_gpu():
    run_on_ranks("nccl", _transposes, world=1)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False, None], ids=["reshard", "keep", "defaults"])
def test_fsdp2_layer_graphs_equal_eager_on_one_gpu(recipe_name, reshard):
    run_on_ranks("nccl", _layers_equal_eager, recipe_name, reshard, True, world=1)


def test_fsdp2_layer_graphs_fp32_params_on_one_gpu():
    run_on_ranks("nccl", _layers_equal_eager, "current", True, False, world=1)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fsdp2_layer_graphs_recompute_on_one_gpu(recipe_name, mode):
    """The recompute captured into each layer's backward CUDA graph after its all-gather: equal
    to eager FSDP2 without recompute and with it; the backward graph holds the recompute."""
    run_on_ranks("nccl", recompute_equals_none, recipe_name, True, True, mode, False,
                 True, True, world=1)  # fmt: skip


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_fsdp2_layer_graphs_recompute_mixed_precision_on_one_gpu(fp8_weights):
    """FSDP2's defaults under MixedPrecisionPolicy (bf16 gathered, fp32 reduced)."""
    mode = "full" if fp8_weights else "selective"
    run_on_ranks("nccl", recompute_equals_none, "delayed", None, fp8_weights, mode, True, world=1)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False, None], ids=["reshard", "keep", "defaults"])
def test_fsdp2_layer_graphs_sync_last_on_one_gpu(recipe_name, reshard):
    """fsdp_sync="last": the unsharded gradients summed by the backward CUDA graphs, each
    layer's sync graph replayed after the last microbatch's backward."""
    run_on_ranks("nccl", _layers_last_equal, recipe_name, reshard, True, world=1)


@pytest.mark.parametrize("fp8_weights, recompute", [(True, "full"), (False, "none")],
                         ids=["fp8-weights-recompute", "fp32-params"])  # fmt: skip
def test_fsdp2_layer_graphs_sync_last_mixed_precision_on_one_gpu(fp8_weights, recompute):
    """MixedPrecisionPolicy: the bf16 unsharded gradients summed in fp32 inside the graphs."""
    run_on_ranks("nccl", _layers_last_equal, "delayed", None, fp8_weights, True,
                 recompute, world=1)  # fmt: skip


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_layer_graphs_prefetch_on_one_gpu(recipe_name, reshard):
    """The block's forward CUDA graph issues the head's all-gather (FSDP2 copies at world size
    1), the head's backward graph the block's; equal to eager FSDP2 with the same prefetch."""
    run_on_ranks("nccl", prefetch_equals_eager, recipe_name, reshard, True, world=1)


def test_fsdp2_layer_graphs_prefetch_with_sync_last_and_recompute_on_one_gpu():
    run_on_ranks("nccl", prefetch_equals_eager, "delayed", None, True, True, "full",
                 "last", world=1)  # fmt: skip


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_fsdp2_layer_graphs_prefetch_on_two_gpus():
    """NCCL all-gathers on the side streams, overlapping the issuing layer's compute."""
    run_on_ranks("nccl", prefetch_equals_eager, "delayed", True, True, world=2)


@pytest.mark.skipif(GPUS < 3, reason="needs 3 GPUs")
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_layer_graphs_on_several_gpus(world):
    run_on_ranks("nccl", _layers_equal_eager, "delayed", True, True, world=world)
