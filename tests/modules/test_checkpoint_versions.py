"""Checkpoints written by older graphfp8 versions load and compute exactly as they did."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8.recipe import recipe_to_dict
from graphfp8.ops import gemm as gemm_module
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import extra_state

DATA = Path(__file__).resolve().parents[1] / "data"
RECIPE = g8.DelayedScaling(amax_history_len=4)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        g8.LayerNormLinear(32, 32), g8.LayerNormMLP(32, 64), g8.Linear(32, 16)
    )


def _microbatch(model, x, first: bool) -> torch.Tensor:
    with g8.fp8_autocast(recipe=RECIPE):
        h = model[0](x, is_first_microbatch=first)
        y = model[2](model[1](h, is_first_microbatch=first), is_first_microbatch=first)
    y.float().pow(2).sum().backward()
    return y.detach()


# Since the fused norms (issue 13) the norms run graphfp8's kernels instead of torch's: their
# float32 sums run in another order (float64 row sums), so what they compute, and what flows from
# their backward, can move by a few float32 ulps (measured: at most 1.4 ulps of the largest
# element). Everything else is still bit for bit what the code of that time computed.
NORM_COMPUTED = {"x_grad", "0.layer_norm_weight", "0.layer_norm_bias", "0.bias",
                 "1.layer_norm_weight", "1.layer_norm_bias", "0.fwd_amax_history"}  # fmt: skip


def _cpu_has_amx_int8() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# The expected file was written on a CPU with AMX-INT8, whose oneDNN FP8 GEMM path the test
# replays (_gemm_path_of_that_time); on other CPUs (e.g. AMD EPYC) oneDNN's FP8 GEMMs round some
# outputs 1 ulp apart, and everything downstream of them (later GEMM inputs, their amaxes and
# scales) moves by as much: there only a few-ulp agreement is checkable.
GEMMS_AS_WRITTEN = _cpu_has_amx_int8()


def _assert_as_before(got, want, name: str) -> None:
    if name not in NORM_COMPUTED and GEMMS_AS_WRITTEN:
        assert_bitwise_equal(got, want, name)
        return
    ulp = torch.finfo(torch.float32).eps * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0.0, atol=4 * ulp, msg=name)


@pytest.fixture
def _two_cpu_threads():
    """The expected file was written with torch's default of 2 intra-op threads (the CI machine's
    cores); torch's CPU LayerNorm backward sums gamma/beta gradients per thread, so another
    thread count moves them by an ulp (tests/conftest.py runs the suite on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def _gemm_path_of_that_time(monkeypatch):
    """The expected file's CPU FP8 GEMMs ran torch's oneDNN `_scaled_mm` path (on this AMX
    machine); graphfp8 now runs torch's fp32 emulation on the CPU, which rounds some outputs 1 ulp
    apart (graphfp8.ops.gemm.onednn_off). This test is about loading the old checkpoint, so it
    runs the GEMMs on the path of that time."""
    monkeypatch.setattr(gemm_module, "onednn_off", contextlib.nullcontext)


@pytest.mark.usefixtures("_two_cpu_threads", "_gemm_path_of_that_time")
def test_version_0_checkpoint_loads_and_computes_as_before():
    """tests/data/checkpoint_v0.pt holds 2 backward slots per GEMM (the unused grad_input one
    included); the code of that time computed checkpoint_v0_expected.pt after loading it."""
    old = torch.load(DATA / "checkpoint_v0.pt", weights_only=True)
    expected = torch.load(DATA / "checkpoint_v0_expected.pt", weights_only=True)
    model = _model()
    model.load_state_dict(old)
    x = expected["x"].clone().requires_grad_()
    outputs = [_microbatch(model, x, first=mb == 0) for mb in range(2)]
    for i, (got, want) in enumerate(zip(outputs, expected["outputs"], strict=True)):
        _assert_as_before(got, want, f"output {i}")
    _assert_as_before(x.grad, expected["x_grad"], "x_grad")
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert sorted(grads) == sorted(expected["grads"])
    for name, grad in grads.items():
        _assert_as_before(grad, expected["grads"][name], name)
    # Afterwards: the same FP8 state, less the dropped grad_input slots (odd backward columns).
    for key, state in model.state_dict().items():
        if not key.endswith("_extra_state"):
            continue
        before = expected["state_after"][key]
        state = extra_state(state)
        assert state["version"] == 2
        module = key.split(".")[0]
        _assert_as_before(state["fwd_amax_history"], before["fwd_amax_history"],
                          f"{module}.fwd_amax_history")  # fmt: skip
        _assert_as_before(state["fwd_scale"], before["fwd_scale"], f"{key}.fwd_scale")
        _assert_as_before(state["bwd_amax_history"], before["bwd_amax_history"][:, 0::2],
                          f"{key}.bwd_amax_history")  # fmt: skip
        _assert_as_before(state["bwd_scale"], before["bwd_scale"][0::2], f"{key}.bwd_scale")


def test_current_checkpoint_round_trips():
    model = _model()
    x = torch.randn(16, 32, requires_grad=True)
    _microbatch(model, x, first=True)
    state = model.state_dict()
    assert extra_state(state["2._extra_state"])["bwd_scale"].shape == (1,), "one slot per GEMM"
    assert extra_state(state["1._extra_state"])["bwd_scale"].shape == (2,)
    fresh = _model()
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        if key.endswith("_extra_state"):
            assert_bitwise_equal(value, state[key], key)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("not a dict", "not one that graphfp8 wrote"),
        ({"recipe": {}}, "not one that graphfp8 wrote"),
        ("version", "has version 7"),
        ("recipe", "invalid recipe"),
        ("v0 shape", "had 2 slots"),
        (
            "tensor version",
            "written in checkpoint format version 3; this graphfp8 reads versions "
            "0 to 2 \\(a newer graphfp8 wrote it",
        ),
        ("tensor size", "its header .* says"),
        ("tensor magic", "not one that graphfp8 wrote"),
    ],
)
def test_foreign_extra_state_raises_clearly(bad, match):
    good = _model()[2]
    with g8.fp8_autocast(recipe=RECIPE):
        good(torch.randn(16, 32), is_first_microbatch=True)
    state = extra_state(good.get_extra_state())
    state["recipe"] = recipe_to_dict(state["recipe"])
    if bad == "version":
        state["version"] = 7
    elif bad == "recipe":
        state["recipe"] = {**state["recipe"], "margin": -1}
    elif bad == "v0 shape":
        del state["version"]
    elif bad == "tensor version":
        state = good.get_extra_state()
        state[1] = 3
    elif bad == "tensor size":
        state = good.get_extra_state()[:-1]
    elif bad == "tensor magic":
        state = torch.ones(40)
    else:
        state = bad
    with pytest.raises(ValueError, match=match):
        g8.Linear(32, 16).set_extra_state(state)
