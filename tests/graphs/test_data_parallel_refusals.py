"""DistributedDataParallel and the graphs (2 gloo ranks): a graph folds gradients into .grad inside
itself, so DDP's gradient hooks never run. Capturing a DDP (or FSDP) module, and replaying graphed
blocks inside a DDP forward, raise before anything runs, naming allreduce_gradients."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import graphfp8 as g8
from tests.graphs.common import assert_unchanged, snapshot
from tests.graphs.step_common import adamw
from tests.modules.common import H, T, build
from tests.test_distributed import launch


def _mse(y, t):
    return F.mse_loss(y.float(), t.float())


def _refusals(rank, device):
    x = torch.randn(2, T, H, dtype=torch.bfloat16, device=device)
    wrapped = DDP(build("LayerNormMLP", device=device))
    captures = {
        "graphed callable 0 (DistributedDataParallel)": lambda: g8.make_graphed_callables(
            wrapped, (x[0].clone().requires_grad_(),)
        ),
        "make_graphed_microbatch": lambda: g8.make_graphed_microbatch(wrapped, _mse, (x[0], x[1])),
        "make_graphed_step": lambda: g8.make_graphed_step(
            wrapped, _mse, adamw(wrapped.parameters(), device), (x, x.clone()), 2
        ),
    }
    for name, capture in captures.items():
        with pytest.raises(
            RuntimeError, match=re.escape(f"{name}: cannot capture DistributedDataParallel")
        ):
            capture()
    # DDP around a model whose block is graphed: DDP never sees the block's gradients (torch
    # failed at the second step, saying that parameters were unused).
    block = build("LayerNormMLP", device=device)
    g8.make_graphed_callables(block, (x[0].clone().requires_grad_(),))
    model = DDP(nn.Sequential(block, nn.Linear(H, H, dtype=torch.bfloat16, device=device)))
    before = snapshot(block)
    with pytest.raises(RuntimeError, match=r"called inside DistributedDataParallel's forward"):
        model(x[0].clone().requires_grad_())
    assert_unchanged(block, before, "nothing ran")
    dist.barrier()


def test_ddp_and_graphs_are_refused():
    launch("gloo", _refusals)
