"""The step graph on 2 ranks (gloo and the CPU tape; NCCL and CUDA graphs on 2 GPUs, marked
`cuda`): the gradient all-reduce and the amax reductions inside the graph. Equal bit for bit to
the eager data-parallel loop on each rank's data, and, with the same data on every rank, to a
single-process step graph on that data."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import (
    RECIPE,
    adamw,
    compare_step,
    compare_training_state,
    eager_step,
)
from tests.modules.common import H, T, build
from tests.test_distributed import BACKENDS, assert_same_on_all_ranks, launch, synced_state

N, STEPS = 2, 2


def mse(y, target):
    return F.mse_loss(y.float(), target.float())


def _batch(seed: int, device):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, T, H, generator=gen).to(torch.bfloat16)
    x[1:] *= 10.0
    return x.to(device), torch.randn(N, T, H, generator=gen).to(device)


def _graphed(model, device, group):
    opt = adamw(model.parameters(), device)
    step = g8.make_graphed_step(
        model, mse, opt, _batch(99, device), N, fp8_enabled=True, fp8_recipe=RECIPE,
        max_grad_norm=1.0, fp8_group=group, process_group=group, num_warmup_iters=1,
        keep_grads_before_clipping=True,
    )  # fmt: skip
    return opt, step


def _rank_data_equals_eager_ddp(rank, device):
    group = dist.group.WORLD
    eager = build("LayerNormMLP", device=device)
    model = copy.deepcopy(eager)
    opt_e = adamw(eager.parameters(), device)
    opt_g, step = _graphed(model, device, group)
    ops = step.captured_ops()
    # amax reductions: one per arena update (2 per microbatch); then one gradient bucket.
    assert ops.count("c10d::allreduce_") == 2 * N + 1
    for s in range(STEPS):
        batch = _batch(100 * rank + s, device)
        result = eager_step(eager, mse, opt_e, batch, N, max_grad_norm=1.0, fp8_group=group,
                            process_group=group)  # fmt: skip
        step(batch)
        compare_step(step, result, f"rank {rank} step {s}")
        compare_training_state(eager, model, opt_e, opt_g, f"rank {rank} step {s}")
    assert_same_on_all_ranks(synced_state(model), "step graph")
    losses = [torch.empty_like(step.loss) for _ in range(2)]
    dist.all_gather(losses, step.loss)
    assert not torch.equal(losses[0], losses[1])  # the ranks saw different data


def _same_data_equals_single_process(rank, device):
    solo = build("LayerNormMLP", device=device)
    model = copy.deepcopy(solo)
    _, solo_step = _graphed(solo, device, None)
    _, step = _graphed(model, device, dist.group.WORLD)
    for s in range(STEPS):
        batch = _batch(s, device)
        solo_step(batch)
        step(batch)
        assert_bitwise_equal(step.loss, solo_step.loss, f"step {s}: loss")
        for i, (g, e) in enumerate(zip(step.grads, solo_step.grads, strict=True)):
            assert_bitwise_equal(g, e, f"step {s}: grad {i}")
        for (name, a), (_, b) in zip(synced_state(model), synced_state(solo), strict=True):
            assert_bitwise_equal(a, b, f"step {s}: {name}")


def _both(rank, device):
    _rank_data_equals_eager_ddp(rank, device)
    _same_data_equals_single_process(rank, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_graph_data_parallel(backend):
    launch(backend, _both)
