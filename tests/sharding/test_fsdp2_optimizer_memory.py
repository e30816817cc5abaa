"""The first fused AdamW step with a tensor learning rate (graphfp8-train's optimizer, the FSDP2
step graph's) over FSDP2's DTensor shards allocates no unsharded transient: DTensor's sharding
propagation ran torch's kernel on zeros of the parameters' global shapes, 16 bytes per fp32
parameter on every rank, before graphfp8.distributed registered the op's meta kernel
(distributed/optimizer_meta.py; docs/sharding.md, "The first optimizer step under FSDP2"), and
the step stays bit for bit the one-process step: on 2 and 3 gloo ranks, and on one GPU (NCCL)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import graphfp8 as g8
from benchmarks.memory_plan import fresh_sharding_propagation
from graphfp8.distributed.optimizer_meta import (
    FUSED_OPTIMIZER_OVERLOADS,
    register_fused_optimizer_meta,
)
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.memory import AllocatedBytes
from graphfp8.testing import assert_bitwise_equal
from tests.rank_pool import run_on_ranks

# fc1's 208 rows in shards of 70, 70 and 68 at 3 ranks; every shard a multiple of 16 elements
# (fused AdamW's vector loop on the CPU rounds its tail otherwise): rows of 96 and 208, no biases
H, FFN, T = 96, 208, 32
RECIPE = g8.DelayedScaling(amax_history_len=4)


def _backward(model, x) -> None:
    with g8.fp8_autocast(recipe=RECIPE):
        y = model(x, is_first_microbatch=True)
    y.float().square().mean().backward()


def _optimizer_step(masters, opt) -> None:
    if masters is not None:
        masters.step(opt)
    else:
        opt.step()


class _CudaPeak:
    """AllocatedBytes' peak and live for the GPU: torch.cuda's allocated bytes in the region."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self.start
        self.live = torch.cuda.memory_allocated() - self.start


def _first_step(rank, device, fp8_weights, world):
    torch.manual_seed(0)
    with g8.fp8_model_init(enabled=fp8_weights):
        ref = g8.LayerNormMLP(H, FFN, bias=False, params_dtype=torch.float32, device=device)
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=init_device_mesh(device.type, (world,)))
    runs = {}
    for key, m in (("ref", ref), ("fsdp", model)):
        masters = g8.MasterWeights(m) if fp8_weights else None
        params = masters.parameters() if masters else list(m.parameters())
        opt = torch.optim.AdamW(params, lr=torch.tensor(1e-2, device=device), betas=(0.9, 0.95),
                                weight_decay=0.1, fused=True)  # fmt: skip
        runs[key] = (m, masters, opt)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(device)  # every rank's
    for m, _, _ in runs.values():
        _backward(m, x)
    _optimizer_step(*runs["ref"][1:])
    fresh_sharding_propagation()  # as in a fresh process: the first step of these shapes
    with _CudaPeak() if device.type == "cuda" else AllocatedBytes() as step:
        _optimizer_step(*runs["fsdp"][1:])
    # the unsharded fp32 parameters: the fallback took 4 such copies (parameters, gradients,
    # both moments), one at a time per dtype group
    unsharded = 4 * sum(p.numel() for p in ref.parameters())
    transient = step.peak - step.live  # above what the step keeps (its moments, master grads)
    assert transient < unsharded / 4, f"rank {rank}: {transient} bytes transient, {unsharded}"
    if world > 2:  # the same data on every rank: FSDP2's mean of 2 equal gradients is exact
        return
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        mine = q.full_tensor()
        want = p.dequantize() if isinstance(p, Float8Tensor) else p.detach()
        got = mine.dequantize() if isinstance(mine, Float8Tensor) else mine
        assert_bitwise_equal(got, want, f"rank {rank}: {name}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_first_fused_adamw_step_holds_no_unsharded_copy(fp8_weights, world):
    run_on_ranks("gloo", _first_step, fp8_weights, world, world=world)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_first_fused_adamw_step_holds_no_unsharded_copy_on_one_gpu(fp8_weights):
    """The same on one GPU (NCCL): torch.cuda's peak of the step, the CUDA kernel's fallback."""
    run_on_ranks("nccl", _first_step, fp8_weights, 1, world=1)


def test_meta_kernels_compute_nothing_and_are_registered_once():
    """Every overload has its meta kernel (a second registration finds them all there), and
    under FakeTensorMode the functional step returns tensors shaped as its inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert register_fused_optimizer_meta() == []
    for name, _ in FUSED_OPTIMIZER_OVERLOADS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"), name
    with FakeTensorMode() as mode:
        p = [mode.from_tensor(torch.randn(5, 3)), mode.from_tensor(torch.randn(7))]
        lists = [p, [torch.empty_like(t) for t in p], [torch.empty_like(t) for t in p],
                 [torch.empty_like(t) for t in p], [],
                 [mode.from_tensor(torch.ones(())) for _ in p]]  # fmt: skip
        out = torch.ops.aten._fused_adamw.tensor_lr(
            *lists, lr=mode.from_tensor(torch.tensor(1e-3)), beta1=0.9, beta2=0.95,
            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
    assert [[tuple(t.shape) for t in ts] for ts in out[:4]] == [[(5, 3), (7,)]] * 4
    assert out[4] == []
