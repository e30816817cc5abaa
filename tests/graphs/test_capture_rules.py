"""What the capturer refuses, before anything runs, and the is_first_microbatch device flag:
many replays enqueued back to back, and no leak into later captures or eager calls."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.ops.switches import switch_on
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, Stack, T, build

RECIPE = g8.DelayedScaling(amax_history_len=4)


def _graphed(kind="Linear", device="cpu", caching=True, requires_grad=True):
    m = build(kind, device=device)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=requires_grad)
    g = g8.make_graphed_callables(m, (sample,), fp8_enabled=True, fp8_recipe=RECIPE,
                                  fp8_weight_caching=caching)  # fmt: skip
    return m, g


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (lambda d: torch.randn(T + 16, H, dtype=torch.bfloat16, device=d), r"\(64, 32\)"),
        (lambda d: torch.randn(T, H, device=d), "torch.float32"),
        (lambda d: torch.randn(T, H, dtype=torch.bfloat16, device=d), "requires_grad=False"),
        (lambda d: torch.randn(T, H, dtype=torch.bfloat16, device="meta"), "on meta"),
    ],
)
def test_replay_with_other_inputs_raises(device, bad, pattern):
    m, g = _graphed(device=device)
    with pytest.raises(ValueError, match=pattern):
        g(bad(device), is_first_microbatch=True)


def test_errors_before_anything_runs(device):
    m, g = _graphed(device=device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="is_first_microbatch=False before any call"):
        g(x, is_first_microbatch=False)
    with pytest.raises(RuntimeError, match="captured with fp8_recipe=.*called inside fp8_autocast"):
        with g8.fp8_autocast(recipe=g8.DelayedScaling(amax_history_len=8)):
            g(x, is_first_microbatch=True)
    with pytest.raises(TypeError, match="captured with 1 tensor arguments, called with 2"):
        g(x, x, is_first_microbatch=True)
    g(x, is_first_microbatch=True)
    handle = m.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="hooks were registered on a captured module"):
        g(x, is_first_microbatch=True)
    handle.remove()
    g(x, is_first_microbatch=False)


def test_capture_refuses_hooks_and_mixed_devices():
    m = build("Linear")
    m.register_forward_pre_hook(lambda *a: None)
    sample = torch.randn(T, H, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must have no hooks"):
        g8.make_graphed_callables(m, (sample,), fp8_enabled=True)
    with pytest.raises(ValueError, match="one device"):
        g8.make_graphed_callables(build("Linear"), (sample.to("meta"),), fp8_enabled=True)
    with pytest.raises(TypeError, match="must be tensors"):
        g8.make_graphed_callables(build("Linear"), (3,), fp8_enabled=True)


def test_caching_off_takes_no_is_first_microbatch(device):
    _, g = _graphed(device=device, caching=False)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="is_first_microbatch=None"):
        g(x, is_first_microbatch=True)
    g(x)


def test_captured_graphs_hold_the_fp8_kernels(device):
    _, g = _graphed("LayerNormMLP", device=device)
    ops = g.captured_ops()
    assert ops["forward"][0] == "graphfp8::scale_update", "the update opens the forward graph"
    assert ops["forward"].count("graphfp8::layernorm_fp8") == 1  # fc1's input, by the norm
    assert ops["forward"].count("graphfp8::cast_transpose") == 2  # the 2 weights
    assert ops["forward"].count("graphfp8::gelu_cast_transpose") == 1  # fc2's input
    assert ops["backward"].count("graphfp8::layernorm_bwd") == 1
    assert ops["backward"][-1] == "graphfp8::scale_update", "and closes the backward graph"
    assert ops["backward"].count("graphfp8::cast_transpose_dbias") == 1  # fc2's grad output
    assert ops["backward"].count("graphfp8::dgelu_cast_transpose_dbias") == 1  # fc1's
    assert ops["forward"].count("aten::_scaled_mm") == 2
    assert ops["backward"].count("aten::_scaled_mm") == 4
    kernels = g.captured_kernels()
    fwd = " ".join(kernels["forward"])
    bwd = " ".join(kernels["backward"])
    assert "scale_update" in fwd and "scale_update" in bwd
    assert "cast_transpose" in fwd and "cast_transpose" in bwd
    gpu = device == "cuda"
    assert ("norm_fwd_kernel" if gpu else "layernorm_fp8") in fwd
    if gpu:
        for kernel, expected in _norm_bwd_kernels().items():
            assert (kernel in bwd) is expected, (kernel, expected)
    else:
        assert "layernorm_bwd" in bwd


def _norm_bwd_kernels() -> dict[str, bool]:
    """{CUDA kernel: launched?} of the norm backward of a 16-bit vectorised row (H), as the
    norm-backward switches now in force choose them (docs/benchmarking.md, "Kernel switches")."""
    v2 = switch_on("NORM_BWD_V2")  # H <= 4096: v2 takes the row, ahead of the staged kernel
    batched = v2 or switch_on("NORM_BWD_BATCHED")
    staged = batched and not v2 and switch_on("NORM_BWD_STAGED")
    one_kernel = staged and switch_on("NORM_BWD_PARAM_IN_KERNEL")
    return {
        "norm_bwd_kernel": not batched,
        "norm_bwd_batched_kernel": batched and not staged and not v2,
        "norm_bwd_staged_kernel": staged,
        "norm_bwd_v2_kernel": v2,
        "param_grad_batched_kernel": batched and not one_kernel,
    }


def test_many_replays_back_to_back_follow_is_first_microbatch(device):
    """64 replays enqueued without a synchronisation, the weight negated in place before every
    step (also enqueued; its amax stays 1, so no scale saturates): every replay must see the
    is_first_microbatch it was called with. A replay outputs y = x @ w_cached.T = +-1; its clone
    is kept and all are checked at the end."""
    m = g8.Linear(H, H, bias=False, params_dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        m.weight.copy_(torch.eye(H, dtype=torch.bfloat16, device=device))
    sample = torch.ones(T, H, dtype=torch.bfloat16, device=device)
    g = g8.make_graphed_callables(m, (sample,), fp8_enabled=True, fp8_recipe=RECIPE,
                                  fp8_weight_caching=True)  # fmt: skip
    x = torch.ones(T, H, dtype=torch.bfloat16, device=device)
    outs, expected, weight = [], [], 1.0
    for i in range(64):
        first = i % 4 == 0
        if first:
            with torch.no_grad():
                m.weight.neg_()
            weight = -weight
        with torch.no_grad():
            outs.append(g(x, is_first_microbatch=first).clone())
        expected.append(weight)
    if device == "cuda":
        torch.cuda.synchronize()
    for i, (out, w) in enumerate(zip(outs, expected, strict=True)):
        assert torch.all(out == w), f"replay {i}: got {out[0, 0].item()}, expected {w}"


def test_noop_flag_does_not_leak_into_later_eager_calls_or_captures(device):
    """After graphed replays that left the flag at 1 (skip), an eager call with None or True
    must cast the new weights, and a second capture must start casting too."""
    model = Stack(device=device)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    g = g8.make_graphed_callables(model, (sample,), fp8_enabled=True, fp8_recipe=RECIPE,
                                  fp8_weight_caching=True)  # fmt: skip
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    g(x, is_first_microbatch=True)
    g(x, is_first_microbatch=False)  # the device flag now says "skip"
    proj = model.proj
    with torch.no_grad():
        proj.weight.mul_(-1.0)
    fresh = copy.deepcopy(proj)
    h = torch.randn(T, 2 * H, dtype=torch.bfloat16, device=device)
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
        for first in (None, True):
            y_eager = proj(h, is_first_microbatch=first)
            y_fresh = fresh(h, is_first_microbatch=first)
            assert_bitwise_equal(y_eager, y_fresh, f"eager call with {first} casts")
    g2 = g8.make_graphed_callables(proj, (h,), fp8_enabled=True, fp8_recipe=RECIPE,
                                   fp8_weight_caching=True)  # fmt: skip
    with torch.no_grad():
        proj.weight.mul_(-1.0)
        fresh.weight.mul_(-1.0)
    with torch.no_grad():
        y2 = g2(h, is_first_microbatch=True)
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
        fresh(h, is_first_microbatch=None)  # brings fresh's scales to the same step
        y_ref = fresh(h, is_first_microbatch=None)
    assert torch.sign(y2.float()).eq(torch.sign(y_ref.float())).float().mean() > 0.99, (
        "the second capture cast the new weights"
    )
