"""An accelerate training loop (accelerator.prepare, accelerator.accumulate, accelerator.backward)
trains a converted model that carries its recipe in FP8 with no FP8 code in the loop (issue 32,
item 3), with a fused AdamW (issue 39: it bumps no version counter), bit for bit as the loop
written with fp8_autocast; on 2 gloo
ranks accelerate's DistributedDataParallel equals graphfp8's own data parallelism
(distributed.allreduce_gradients, amaxes MAX-reduced over fp8_group) bit for bit, and under
FSDP2 the carried model runs as under fp8_autocast (graphs and DDP:
tests/graphs/test_data_parallel_refusals.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.distributed import allreduce_gradients
from graphfp8.testing import assert_bitwise_equal
from tests.hf.common import RECIPE, assert_same_training, batch, hf_model
from tests.rank_pool import WORLD
from tests.test_distributed import launch

accelerate = pytest.importorskip("accelerate")
STEPS, MICRO = 3, 2


def _accelerate_loop(model, accelerator, steps: int, rank: int = 0):
    """The loop from accelerate's gradient-accumulation guide, unchanged; returns the prepared
    model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for step in range(steps):
        for mb in range(MICRO):
            x = batch(step, WORLD * mb + rank)
            with g8.fp8_autocast(recipe=RECIPE, fp8_group=group):
                loss = model(x, labels=x, is_first_microbatch=None).loss
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
        _fsdp2_runs_as_fp8_autocast(group)
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        for key in env:  # the rank process serves other tests next
            os.environ.pop(key, None)


def _fsdp2_runs_as_fp8_autocast(group) -> None:
    """FSDP2 (fully_shard, what accelerate's FSDP plugin and torchtitan use): the carried model
    runs as the same model under fp8_autocast does (docs/sharding.md, "FSDP2"; it was refused)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    carried = g8.from_hf(hf_model("llama").train(), recipe=RECIPE, fp8_group=group)
    plain = g8.from_hf(hf_model("llama").train())
    fully_shard(carried, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    x = batch(0, dist.get_rank())
    got = carried(x, labels=x).loss
    got.backward()
    with g8.fp8_autocast(recipe=RECIPE, fp8_group=group):
        want = plain(x, labels=x).loss
    want.backward()
    assert_bitwise_equal(got, want, "loss under fully_shard")
    for a, b in zip(carried.layers, plain.layers, strict=True):
        assert_bitwise_equal(a.qkv.fp8_meta.fwd.history(), b.qkv.fp8_meta.fwd.history(), "QKV")
        assert_bitwise_equal(a.qkv.weight.grad.full_tensor(), b.qkv.weight.grad.full_tensor(),
                             "QKV grad")  # fmt: skip


def test_accelerate_ddp_equals_graphfp8_data_parallel():
    launch("gloo", _ddp_against_graphfp8)
