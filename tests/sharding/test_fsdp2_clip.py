"""Clipping an FSDP2 model trained through FSDPMasterWeights (gloo, 2 and 3 ranks, each its own
data): torch.nn.utils.clip_grad_norm_ of masters.parameters() (the documented idiom), of
model.parameters() and masters.clip_grad_norm_ give the same norm and the same training, bit for
bit. The masters' grads were None until step, so the first left the FP8 weights out of the norm
and unclipped, silently (docs/sharding.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import graphfp8 as g8
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.testing import assert_bitwise_equal
from tests.rank_pool import run_on_ranks

H, FFN, T = 32, 64, 48
RECIPE = g8.DelayedScaling(amax_history_len=4)
MAX_NORM = 0.01  # below every step's norm: each step clips


def _clip(how: str, model, masters) -> torch.Tensor:
    if how == "masters.clip_grad_norm_":
        return masters.clip_grad_norm_(MAX_NORM)
    params = masters.parameters() if how == "torch, masters" else model.parameters()
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _train(how: str, rank: int, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(each step's norm, the model's local shards and the masters after 3 clipped steps)."""
    torch.manual_seed(0)
    with g8.fp8_model_init():
        model = g8.LayerNormMLP(H, FFN, params_dtype=torch.float32, device=device)
    fully_shard(model, mesh=init_device_mesh(torch.device(device).type, (dist.get_world_size(),)))
    masters = g8.MasterWeights(model)
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-2)
    norms = []
    for step in range(3):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(10 * step + rank))
        x = x.to(device)
        with g8.fp8_autocast(recipe=RECIPE):
            y = model(x, is_first_microbatch=True)
        y.float().square().mean().backward()
        norms.append(_clip(how, model, masters))
        masters.step(opt)
        masters.zero_grad()
    state = []
    for q in model.parameters():
        t = q._local_tensor
        state += [t._data.view(torch.uint8), t._scale_inv] if isinstance(t, Float8Tensor) else [t]
    return norms, state + [m._local_tensor for m in masters.masters]


def _idioms_agree(rank, device):
    ref_norms, ref_state = _train("torch, model", rank, device)
    assert all(float(n) > MAX_NORM for n in ref_norms), ref_norms
    for how in ("torch, masters", "masters.clip_grad_norm_"):
        norms, state = _train(how, rank, device)
        for step, (n, r) in enumerate(zip(norms, ref_norms, strict=True)):
            assert_bitwise_equal(n, r, f"{how}: step {step}'s norm")
        for i, (a, b) in enumerate(zip(state, ref_state, strict=True)):
            assert_bitwise_equal(a, b, f"{how}: tensor {i} after 3 steps")


def test_clipping_the_masters_equals_clipping_the_model():
    for world in (2, 3):
        run_on_ranks("gloo", _idioms_agree, world=world)
