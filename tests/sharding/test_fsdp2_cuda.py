"""FSDP2 with FP8 weights on GPUs (NCCL, tests/rank_pool.py, one GPU per rank): the default
reshard_after_forward=True equals False bit for bit (the NaN of issue 40 on the GPU: the
re-gathered weight's transpose rebuilt by the backward), on one GPU and on 2 and 3 where the
machine has them; a DCP checkpoint saved at 2 GPUs loads at 3 (skipped with fewer); clipping
masters.parameters() equals clipping model.parameters() on one GPU; make_graphed_microbatch of
the FSDP2 model (a CUDA graph holding FSDP2's forward and backward) equals eager FSDP2 on one
GPU."""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import run_on_ranks
from tests.sharding.test_dcp_world_sizes import _at_2_again, _at_2_first, _at_3
from tests.sharding.test_fsdp2_clip import _idioms_agree
from tests.sharding.test_fsdp2_graphs import _graphed_equals_eager
from tests.sharding.test_fsdp2_reshard import _reshard_equals_no_reshard

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
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_microbatch_graph_equals_eager_on_one_gpu(recipe_name, reshard):
    run_on_ranks("nccl", _graphed_equals_eager, recipe_name, reshard, True, world=1)


def test_fsdp2_microbatch_graph_fp32_params_on_one_gpu():
    run_on_ranks("nccl", _graphed_equals_eager, "delayed", True, False, world=1)


@pytest.mark.skipif(GPUS < 3, reason="needs 3 GPUs")
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_microbatch_graph_on_several_gpus(world):
    run_on_ranks("nccl", _graphed_equals_eager, "delayed", True, True, world=world)
