"""torch.autocast and the three graph entry points: a replay under another autocast state than its
capture's raises before anything runs (eager would compute in other dtypes), and one under the
same state equals the eager code under it, bit for bit (docs/after-capture.md)."""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import assert_unchanged, compare_models, snapshot
from tests.graphs.step_common import adamw, compare_step, eager_step
from tests.modules.common import H, T, build

RECIPE = g8.DelayedScaling(amax_history_len=4)
FP8 = dict(fp8_enabled=True, fp8_recipe=RECIPE, fp8_weight_caching=True)
ENTRIES = ["callables", "microbatch", "step"]
BF16, FP16 = torch.bfloat16, torch.float16


def _autocast(device, dtype):
    """torch.autocast for the device's type in `dtype`; None: no autocast."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def _mse(y, t):
    return F.mse_loss(y.float(), t.float())


def _capture(entry: str, model, device):
    """Captures `model` through `entry` (in the caller's autocast state); returns a function that
    runs one call of it (with its backward, for callables) on a fresh batch."""
    x = torch.randn(2, T, H, device=device)
    if entry == "callables":
        g = g8.make_graphed_callables(model, (x[0].clone().requires_grad_(),), **FP8)
        return lambda: (
            g(torch.randn_like(x[0]).requires_grad_(), is_first_microbatch=True).sum().backward()
        )
    if entry == "microbatch":
        g = g8.make_graphed_microbatch(model, _mse, (x[0], x[1]), **FP8)
        return lambda: g((torch.randn_like(x[0]), x[1]), is_first_microbatch=True)
    g = g8.make_graphed_step(model, _mse, adamw(model.parameters(), device), (x, x), 2,
                             fp8_enabled=True, fp8_recipe=RECIPE)  # fmt: skip
    return lambda: g((torch.randn_like(x), x))


def _text(device, dtype) -> str:
    kind = torch.device(device).type
    if dtype is None:
        return rf"outside torch.autocast\('{kind}'\)"
    return rf"under torch.autocast\('{kind}', dtype={dtype}\)"


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(
    "captured, called",
    [(None, BF16), (BF16, None), (BF16, FP16)],
    ids=["off-on", "on-off", "dtype"],
)
def test_a_replay_in_another_autocast_state_raises_before_running(device, entry, captured, called):
    """fp32 layers: under torch.autocast(bf16) eager returns bf16, the graph captured outside it
    fp32; the other way round, or another dtype, likewise. Each raises before any state moves,
    and the captured state still replays."""
    model = build("LayerNormMLP", dtype=torch.float32, device=device)
    with _autocast(device, captured):
        call = _capture(entry, model, device)
        call()
    before = snapshot(model)
    with _autocast(device, called), pytest.raises(RuntimeError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith("make_graphed" if entry != "callables" else "graphed callable 0")
    pattern = f"captured {_text(device, captured)}, called {_text(device, called)}"
    assert re.search(pattern, msg), msg
    assert "capture it again" in msg
    assert_unchanged(model, before, "nothing ran")
    with _autocast(device, captured):
        call()


def test_microbatch_under_autocast_equals_eager_under_autocast(device):
    """Captured and replayed under torch.autocast(bf16): the eager microbatch's bits under it
    (the CPU tape replays the ops autocast chose at capture, not recast again)."""
    eager = build("Stack", dtype=torch.float32, device=device)
    model = copy.deepcopy(eager)
    x = torch.randn(T, H, device=device)
    with _autocast(device, BF16):
        g = g8.make_graphed_microbatch(model, _mse, (x, x.clone()), 2, **FP8)
    for mb in range(3):
        batch = (torch.randn(T, H, device=device), torch.randn(T, H, device=device))
        with _autocast(device, BF16):
            with g8.fp8_autocast(recipe=RECIPE):
                out = eager(batch[0], is_first_microbatch=mb == 0)
            want = _mse(out, batch[1]) / 2
            want.backward()
            got = g(batch, is_first_microbatch=mb == 0)
        assert_bitwise_equal(got, want, f"mb {mb}: loss")
        compare_models(eager, model, f"mb {mb}")


def test_step_under_autocast_equals_eager_under_autocast(device):
    eager = build("Stack", dtype=torch.float32, device=device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)
    x = torch.randn(2, T, H, device=device)
    with _autocast(device, BF16):
        g = g8.make_graphed_step(model, _mse, opt_g, (x, x.clone()), 2, fp8_enabled=True,
                                 fp8_recipe=RECIPE, max_grad_norm=1.0)  # fmt: skip
    for step in range(2):
        batch = (torch.randn(2, T, H, device=device), torch.randn(2, T, H, device=device))
        with _autocast(device, BF16):
            result = eager_step(eager, _mse, opt_e, batch, 2, max_grad_norm=1.0)
            g(batch)
        compare_step(g, result, f"step {step}")
        for (name, pe), (_, pg) in zip(eager.named_parameters(), model.named_parameters(),
                                       strict=True):  # fmt: skip
            assert_bitwise_equal(pg, pe, f"step {step}: weight {name}")


class TorchMLP(nn.Module):
    """torch layers only, fp32: under torch.autocast their GEMMs run in bf16 on casts of the
    weights, which autocast caches for the rest of its region."""

    def __init__(self, device):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 2 * H, device=device), nn.Linear(2 * H, H, device=device)

    def forward(self, x, is_first_microbatch=None):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("entry", ENTRIES)
def test_torch_layers_captured_under_autocast_follow_the_optimizer(device, entry):
    """A capture inside torch.autocast records its own weight casts instead of reusing those that
    autocast cached while warming up: after every optimizer step the graph casts the new weights,
    as eager code does (the microbatch and step graphs kept the first weights' casts)."""
    eager = TorchMLP(device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)
    x = torch.randn(2, T, H, device=device)
    with _autocast(device, BF16):
        if entry == "step":
            g = g8.make_graphed_step(model, _mse, opt_g, (x, x.clone()), 2)
        elif entry == "microbatch":
            g = g8.make_graphed_microbatch(model, _mse, (x[0], x[1]))
        else:
            g = g8.make_graphed_callables(model, (x[0],))
    for step in range(3):
        batch = (torch.randn(2, T, H, device=device), torch.randn(2, T, H, device=device))
        with _autocast(device, BF16):
            if entry == "step":
                result = eager_step(eager, _mse, opt_e, batch, 2, fp8=False, caching=False)
                g(batch)
                compare_step(g, result, f"step {step}")
                continue
            want = _mse(eager(batch[0][0]), batch[1][0])
            want.backward()
            if entry == "microbatch":
                got = g((batch[0][0], batch[1][0]))
            else:
                got = _mse(g(batch[0][0]), batch[1][0])
                got.backward()
        assert_bitwise_equal(got, want, f"step {step}: loss")
        compare_models(eager, model, f"step {step}")
        for opt in (opt_e, opt_g):
            opt.step()
            opt.zero_grad()


# The weight-cache flag's errors name the entry point that was called ----------------------------


@pytest.mark.parametrize("entry", ["callables", "microbatch"])
def test_weight_cache_errors_name_the_entry_point(entry):
    x = torch.randn(T, H, dtype=torch.bfloat16)
    name, what = f"make_graphed_{entry}", f"graphed {entry.removesuffix('s')}"

    def capture(caching):
        model = build("Linear")
        opts = dict(FP8, fp8_weight_caching=caching)
        if entry == "callables":
            g = g8.make_graphed_callables(model, (x.clone().requires_grad_(),), **opts)
            return model, lambda first: g(x.clone().requires_grad_(), is_first_microbatch=first)
        g = g8.make_graphed_microbatch(model, lambda y: y.float().square().mean(), x, **opts)
        return model, lambda first: g(x, is_first_microbatch=first)

    model, call = capture(False)
    before = snapshot(model)
    with pytest.raises(ValueError) as err:
        call(True)
    assert str(err.value).startswith(f"{name}(fp8_weight_caching=False) casts the weights")
    assert f"call the {what} with is_first_microbatch=None" in str(err.value)
    assert_unchanged(model, before, "nothing ran")
    model, call = capture(True)
    before = snapshot(model)
    with pytest.raises(RuntimeError) as err:
        call(False)
    assert str(err.value).startswith(f"{name}: the {what} was called with is_first_microbatch=F")
    assert_unchanged(model, before, "nothing ran")
