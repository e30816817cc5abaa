"""What the sharding tests share: a tiny LM (FP8 primary weights or not) with a parameter smaller
than the ranks, the unsharded data-parallel step (allreduce_gradients + unsharded MasterWeights)
and the sharded one, and comparisons of the whole training state."""

from __future__ import annotations

import contextlib
import io
import os

import torch
import torch.distributed as dist
from torch import nn

import graphfp8 as g8
from graphfp8 import distributed
from graphfp8.distributed import allreduce_gradients
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.testing import assert_bitwise_equal
from graphfp8.training import cli
from tests.graphs.step_common import TinyLM, adamw, lm_batch, lm_loss
from tests.modules.common import fp8_state

RECIPES = {"delayed": g8.DelayedScaling(amax_history_len=4), "current": g8.Float8CurrentScaling()}
MB = 2  # microbatches per step


class GainLM(TinyLM):
    """TinyLM whose logits are scaled by the mean of a 2-element gain: a parameter smaller than
    3 ranks (it lies on one or two of them)."""

    def __init__(self, device="cpu", dtype=torch.float32):
        super().__init__(device=device, dtype=dtype)
        self.gain = nn.Parameter(torch.tensor([1.0, 1.2], dtype=dtype, device=device))

    def forward(self, tokens, is_first_microbatch=None):
        return super().forward(tokens, is_first_microbatch) * self.gain.mean()


def build_lm(device, fp8_weights: bool = True, dtype=torch.float32) -> GainLM:
    """The same initial model on every rank and in every call."""
    torch.manual_seed(0)
    with g8.fp8_model_init(enabled=fp8_weights):
        return GainLM(device=device, dtype=dtype)


def batch(step: int, device, rank: int = 0, same_on_all_ranks: bool = False):
    """Step `step`'s (tokens, targets) for this rank, each (MB, B, S)."""
    return lm_batch(MB, device, seed=100 * step + (0 if same_on_all_ranks else rank))


def microbatches(model, data, group, recipe) -> torch.Tensor:
    """Forward and backward of MB microbatches (FP8 amaxes MAX-reduced over `group`). Returns
    the loss."""
    tokens, targets = data
    total = torch.zeros(())
    for i in range(MB):
        with g8.fp8_autocast(recipe=recipe, fp8_group=group):
            out = model(tokens[i], is_first_microbatch=i == 0)
        loss = lm_loss(out, targets[i]) / MB
        loss.backward()
        total += loss.detach().cpu()
    return total


class Unsharded:
    """Data parallel without sharding: allreduce_gradients, then an unsharded MasterWeights (FP8
    weights) or the plain parameters stepping the same fused AdamW."""

    def __init__(self, model, device, group, **optimizer_kw):
        self.model, self.group = model, group
        fp8 = any(isinstance(p, Float8Tensor) for p in model.parameters())
        self.masters = g8.MasterWeights(model) if fp8 else None
        params = self.masters.parameters() if fp8 else list(model.parameters())
        self.opt = adamw(params, device, **optimizer_kw)
        self.params = params

    def step(self, data, recipe, max_grad_norm=None):
        loss = microbatches(self.model, data, self.group, recipe)
        allreduce_gradients(self.model.parameters(), self.group)
        norm = None
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)
        if self.masters is not None:
            self.masters.step(self.opt)
            self.masters.zero_grad()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss, norm


class Sharded:
    """The same training with MasterWeights(model, shard_group=group)."""

    def __init__(self, model, device, group, shard_group=None, optimizer_kw=None, **options):
        self.model, self.group = model, group
        self.masters = g8.MasterWeights(model, shard_group=shard_group or group, **options)
        self.opt = adamw(self.masters.parameters(), device, **(optimizer_kw or {}))

    def step(self, data, recipe, max_grad_norm=None):
        loss = microbatches(self.model, data, self.group, recipe)
        norm = None
        if max_grad_norm is not None:
            norm = self.masters.clip_grad_norm_(max_grad_norm)
        self.masters.step(self.opt)
        self.masters.zero_grad()
        return loss, norm


def compare_models(a, b, what: str) -> None:
    """Every parameter (FP8 data and scale_inv bit for bit), FP8 scale and amax history."""
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if isinstance(pa, Float8Tensor):
            assert_bitwise_equal(pa._data.view(torch.uint8), pb._data.view(torch.uint8),
                                 f"{what}: {name} data")  # fmt: skip
            assert_bitwise_equal(pa._scale_inv, pb._scale_inv, f"{what}: {name} scale_inv")
        else:
            assert_bitwise_equal(pa.detach(), pb.detach(), f"{what}: {name}")
    for (name, sa), (_, sb) in zip(fp8_state(a), fp8_state(b), strict=True):
        assert_bitwise_equal(sa, sb, f"{what}: {name}")


def state_bytes(opt) -> int:
    """Bytes of the optimizer's per-parameter moment tensors (exp_avg, exp_avg_sq)."""
    return sum(s[k].numel() * s[k].element_size() for s in opt.state.values()
               for k in ("exp_avg", "exp_avg_sq") if k in s)  # fmt: skip


def world() -> int:
    return dist.get_world_size()


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of graphfp8-train's cli.main(argv) on this rank of the pool's
    process group, as torchrun would start it (kept: main's cleanup is skipped)."""
    env, cleanup = os.environ.get("WORLD_SIZE"), distributed.cleanup
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    distributed.cleanup = lambda: None
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = cli.main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    finally:
        distributed.cleanup = cleanup
        if env is None:
            del os.environ["WORLD_SIZE"]
    return code, out.getvalue(), err.getvalue()
