"""An accelerate training loop (accelerator.prepare, accelerator.accumulate, accelerator.backward)
trains a converted model that carries its recipe in FP8 with no FP8 code in the loop (issue 32,
item 3), bit for bit as the loop written with fp8_autocast and is_first_microbatch; on 2 gloo
ranks accelerate's DistributedDataParallel equals graphfp8's own data parallelism
(distributed.allreduce_gradients, amaxes MAX-reduced over fp8_group) bit for bit, and FSDP is
refused naming what to use (graphs and DDP: tests/graphs/test_data_parallel_refusals.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.distributed import allreduce_gradients
from tests.hf.common import RECIPE, assert_same_training, batch, hf_model
from tests.rank_pool import WORLD
from tests.test_distributed import launch

accelerate = pytest.importorskip("accelerate")
STEPS, MICRO = 3, 2


def _accelerate_loop(model, accelerator, steps: int, rank: int = 0):
    """The loop from accelerate's gradient-accumulation guide, unchanged; returns the prepared
    model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    for i in range(steps * MICRO):
        x = batch(i // MICRO, WORLD * (i % MICRO) + rank)
        with accelerator.accumulate(model):
            loss = model(x, labels=x).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    return model


def _explicit_loop(model, steps: int, rank: int = 0, group=None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        for mb in range(MICRO):
            x = batch(step, WORLD * mb + rank)
            with g8.fp8_autocast(recipe=RECIPE, fp8_group=group):
                loss = model(x, labels=x, is_first_microbatch=mb == 0).loss
            (loss / MICRO).backward()
        allreduce_gradients(model.parameters(), group)
        opt.step()
        opt.zero_grad()


@pytest.fixture
def _fresh_accelerate():
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.usefixtures("_fresh_accelerate")
def test_an_accelerate_loop_trains_in_fp8_as_the_explicit_loop():
    carried = g8.from_hf(hf_model("llama").train(), recipe=RECIPE)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    _accelerate_loop(carried, acc, STEPS)
    plain = g8.from_hf(hf_model("llama").train())
    _explicit_loop(plain, STEPS)
    assert_same_training(plain, carried, "after 3 steps")


def _ddp_against_graphfp8(rank, device):
    env = dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29511",
    )  # what a launcher sets: accelerate reads it
    os.environ.update(env)
    group = dist.group.WORLD
    try:
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
        assert acc.distributed_type == accelerate.DistributedType.MULTI_CPU
        carried = g8.from_hf(hf_model("qwen2").train(), recipe=RECIPE, fp8_group=group)
        wrapped = _accelerate_loop(carried, acc, STEPS, rank)
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        plain = g8.from_hf(hf_model("qwen2").train())
        _explicit_loop(plain, STEPS, rank, group)
        assert_same_training(plain, carried, f"rank {rank}")
        _fsdp_is_refused(group)
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        for key in env:  # the rank process serves other tests next
            os.environ.pop(key, None)


def _fsdp_is_refused(group) -> None:
    """FSDP2 (fully_shard, what accelerate's FSDP plugin and torchtitan use) shards the weights
    into DTensors: the carried model refuses it before any FP8 work."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    lm = g8.from_hf(hf_model("llama").train(), recipe=RECIPE, fp8_group=group)
    fully_shard(lm, mesh=init_device_mesh("cpu", (WORLD,)))
    x = batch(0, 0)
    with pytest.raises(RuntimeError, match="sharded \\(FSDP.*use DistributedDataParallel"):
        lm(x, labels=x)
    assert lm.layers[0].qkv.fp8_meta.fwd.history().abs().sum() == 0, "nothing ran in FP8"


def test_accelerate_ddp_equals_graphfp8_data_parallel():
    launch("gloo", _ddp_against_graphfp8)
