"""The amax passes of current scaling (amax, gelu_amax, dgelu_amax, layernorm_amax,
rmsnorm_amax) and the casts' `scaled_max` form, which computes the slot's scale on the device.

The invariants the fused current-scaling path rests on (graphfp8/fp8/current.py), on every
device bit for bit: an amax pass folds exactly the amax that its cast folds; a cast given
scaled_max leaves the slot, its outputs and scale_inv exactly as the one-slot scale_update
followed by the plain cast does, whatever H[0] holds (0, a value, inf, NaN, a denormal whose
scale overflows) and also when its noop flag skips the cast.
"""

from __future__ import annotations

import math

import pytest
import torch

from graphfp8 import reference
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import CUDA_PARAM, FP8_DTYPES, HP_DTYPES, poison

G = torch.ops.graphfp8
SHAPES = [(1, 1), (7, 33), (64, 80), (130, 258)]
# (H[0], previous scale): 0 keeps the scale, inf and NaN keep it, a denormal overflows to
# FLT_MAX, an infinite previous scale becomes FLT_MAX when kept.
SLOT_STATES = [(0.0, 2.0), (3.5, 2.0), (math.inf, 0.5), (math.nan, 4.0), (1e-42, 1.0),
               (0.0, math.inf), (448.0, 1.0)]  # fmt: skip


def _x(shape, dtype, device, specials=True):
    return fp8_test_data(shape, dtype, specials=specials).clamp(-1e4, 1e4).to(device)


@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(0, 16)])
def test_amax_matches_twin_and_the_cast(device, hp_dtype, shape):
    x = _x(shape, hp_dtype, device)
    got, want, cast = (torch.full((1,), 0.25, device=device) for _ in range(3))
    G.amax(x, got)
    reference.amax(x, want)
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    G.cast_to_fp8(x, torch.ones(1, device=device), out, torch.empty(1, device=device), cast)
    assert_bitwise_equal(got, want, "amax vs twin")
    assert_bitwise_equal(got, cast, "amax vs the cast's amax")


def test_amax_noop_reads_nothing(device):
    x = torch.randn(16, 16, device=device)
    amax = torch.zeros(1, device=device)
    G.amax(x, amax, torch.ones(1, device=device))
    assert amax.item() == 0.0
    G.amax(x, amax, torch.zeros(1, device=device))
    assert amax.item() == x.abs().max().item()


@pytest.mark.parametrize("act", ["gelu", "dgelu"])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_activation_amax_equals_the_fused_cast(device, act, hp_dtype, shape):
    """Bit for bit the amax that gelu_cast_transpose / dgelu_cast_transpose_dbias fold: the same
    f (fused_act.cuh, cpu/fused_act.h) and an order-independent max."""
    h = (torch.randn(shape) * 3).to(hp_dtype).to(device)
    dy = _x(shape, hp_dtype, device, specials=False)
    got, cast = torch.zeros(1, device=device), torch.zeros(1, device=device)
    outs = (torch.empty(shape, dtype=torch.float8_e5m2, device=device),
            torch.empty(shape[::-1], dtype=torch.float8_e5m2, device=device),
            torch.empty(1, device=device))  # fmt: skip
    one = torch.ones(1, device=device)
    if act == "gelu":
        G.gelu_amax(h, got)
        G.gelu_cast_transpose(h, one, *outs, cast)
    else:
        G.dgelu_amax(dy, h, got)
        dbias = torch.empty(shape[1], dtype=hp_dtype, device=device)
        G.dgelu_cast_transpose_dbias(dy, h, one, *outs, cast, dbias)
    assert_bitwise_equal(got, cast, f"{act}_amax vs the cast's amax")


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("residual, zero_centered", [(False, False), (True, True)])
def test_norm_amax_equals_the_norm(device, norm, hp_dtype, residual, zero_centered):
    shape = (37, 96)
    x = (torch.randn(shape) * 3 + 1).to(hp_dtype).to(device)
    res = (torch.randn(shape)).to(hp_dtype).to(device) if residual else None
    gamma = (torch.randn(shape[1]) * 0.2 + (0 if zero_centered else 1)).to(hp_dtype).to(device)
    beta = (torch.randn(shape[1]) * 0.5).to(hp_dtype).to(device)
    got, cast = torch.zeros(1, device=device), torch.zeros(1, device=device)
    f32 = dict(device=device)
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    tail = (None, res, torch.empty_like(x) if residual else None)
    if norm == "LayerNorm":
        G.layernorm_amax(x, gamma, beta, 1e-5, zero_centered, got, res)
        G.layernorm_fp8(x, gamma, beta, 1e-5, zero_centered, torch.ones(1, **f32), out, None,
                        torch.empty(1, **f32), cast, torch.empty(shape[0], **f32),
                        torch.empty(shape[0], **f32), *tail)  # fmt: skip
    else:
        G.rmsnorm_amax(x, gamma, 1e-5, zero_centered, got, res)
        G.rmsnorm_fp8(x, gamma, 1e-5, zero_centered, torch.ones(1, **f32), out, None,
                      torch.empty(1, **f32), cast, torch.empty(shape[0], **f32), *tail)  # fmt: skip
    assert_bitwise_equal(got, cast, f"{norm} amax vs the norm's amax")
    if device == "cpu":
        want = torch.zeros(1)
        twin = reference.layernorm_amax if norm == "LayerNorm" else reference.rmsnorm_amax
        args = (x, gamma, beta) if norm == "LayerNorm" else (x, gamma)
        twin(*args, 1e-5, zero_centered, want, res)
        assert_bitwise_equal(got, want, f"{norm} amax vs twin")


def _cast_args(op, x, dev, fp8_dtype):
    """The op's tensors after x and before the scale, and after the amax, fresh on `dev`."""
    rows, cols = x.shape
    out = poison(torch.empty(rows, cols, dtype=fp8_dtype, device=dev))
    out_t = poison(torch.empty(cols, rows, dtype=fp8_dtype, device=dev))
    scale_inv = torch.full((1,), 7.0, device=dev)
    if op == "cast_to_fp8":
        return [], [out, scale_inv], []
    if op in ("cast_transpose", "gelu_cast_transpose"):
        return [], [out, out_t, scale_inv], []
    dbias = poison(torch.empty(cols, dtype=x.dtype, device=dev))
    first = [(torch.randn(rows, cols) * 2).to(x.dtype).to(dev)] if op.startswith("dgelu") else []
    return first, [out, out_t, scale_inv], [dbias]


def _cast_both_ways(op, x, first, outs, tail, scale, h0, scaled_max, fused: bool) -> list:
    """op in its scaled_max form (fused), or scale_update of the one-slot history then op with a
    throwaway amax; returns the slot and every output, to compare the two."""
    fn = getattr(G, op)
    if fused:
        fn(x, *first, scale, *outs, h0, *tail, scaled_max=scaled_max)
    else:
        G.scale_update(h0.view(1, 1), scale, scaled_max, True)
        fn(x, *first, scale, *outs, torch.zeros(1, device=x.device), *tail)
    return [scale, h0, *outs, *tail]


CAST_OPS = ["cast_to_fp8", "cast_transpose", "cast_transpose_dbias", "gelu_cast_transpose",
            "dgelu_cast_transpose_dbias"]  # fmt: skip


@pytest.mark.parametrize("op", CAST_OPS)
@pytest.mark.parametrize("state", SLOT_STATES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_scaled_max_form_equals_update_then_cast(device, op, state, fp8_dtype):
    """op(..., amax=H0, scaled_max) == scale_update of the one-slot history, then op(..., sink):
    the slot (scale, H0), every output and scale_inv, bit for bit, on the same device."""
    x = _x((64, 48), torch.bfloat16, device)
    results = []
    for fused in (True, False):
        torch.manual_seed(7)
        first, outs, tail = _cast_args(op, x, device, fp8_dtype)
        scale = torch.tensor([state[1]], device=device)
        h0 = torch.tensor([state[0]], device=device)
        scaled_max = torch.tensor([448.0 if fp8_dtype == torch.float8_e4m3fn else 57344.0],
                                  device=device)  # fmt: skip
        results.append(_cast_both_ways(op, x, first, outs, tail, scale, h0, scaled_max, fused))
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert_bitwise_equal(a, b, f"{op} tensor {i}")


@pytest.mark.parametrize("state", SLOT_STATES[:3])
def test_scaled_max_form_updates_the_slot_when_noop_skips_the_cast(device, state):
    x = torch.randn(32, 32, device=device)
    scale, h0 = torch.tensor([state[1]], device=device), torch.tensor([state[0]], device=device)
    want_scale, want_h0 = scale.clone(), h0.clone()
    scaled_max = torch.tensor([448.0], device=device)
    reference.scale_update(want_h0.view(1, 1), want_scale, scaled_max, True)
    out = poison(torch.empty(32, 32, dtype=torch.float8_e4m3fn, device=device))
    before = out.clone()
    G.cast_transpose(x, scale, out, torch.empty_like(out), torch.empty(1, device=device), h0,
                     torch.ones(1, device=device), scaled_max)  # fmt: skip
    assert_bitwise_equal(scale, want_scale, "scale")
    assert_bitwise_equal(h0, want_h0, "H[0]")
    assert_bitwise_equal(out, before, "nothing cast")


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("state", SLOT_STATES[:4])
def test_norm_scaled_max_form_equals_update_then_norm(device, norm, state):
    x = (torch.randn(48, 80) * 2).to(torch.bfloat16).to(device)
    gamma = torch.randn(80).to(torch.bfloat16).to(device)
    beta = torch.randn(80).to(torch.bfloat16).to(device)
    results = []
    for fused in (True, False):
        scale = torch.tensor([state[1]], device=device)
        h0 = torch.tensor([state[0]], device=device)
        scaled_max = torch.tensor([448.0], device=device)
        outs = [torch.zeros(48, 80, dtype=torch.float8_e4m3fn, device=device),
                torch.zeros(80, 48, dtype=torch.float8_e4m3fn, device=device),
                torch.zeros(1, device=device)]  # fmt: skip
        stats = [torch.zeros(48, device=device) for _ in range(2 if norm == "LayerNorm" else 1)]
        if not fused:
            reference.scale_update(h0.view(1, 1), scale, scaled_max, True)
        amax = h0 if fused else torch.zeros(1, device=device)
        extra = dict(scaled_max=scaled_max) if fused else {}
        if norm == "LayerNorm":
            G.layernorm_fp8(x, gamma, beta, 1e-5, False, scale, *outs, amax, *stats, **extra)
        else:
            G.rmsnorm_fp8(x, gamma, 1e-5, False, scale, *outs, amax, *stats, **extra)
        results.append([scale, h0, *outs, *stats])
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert_bitwise_equal(a, b, f"{norm} tensor {i}")


@pytest.mark.parametrize("op", ["cast_to_fp8", "cast_transpose"])
def test_scaled_max_twin_matches_the_op(op):
    x = _x((16, 32), torch.bfloat16, "cpu")
    got, want = [], []
    for fn, acc in ((getattr(G, op), got), (getattr(reference, op), want)):
        scale, h0 = torch.tensor([2.0]), torch.tensor([5.0])
        _, outs, _ = _cast_args(op, x, "cpu", torch.float8_e4m3fn)
        fn(x, scale, *outs, h0, None, torch.tensor([448.0]))
        acc += [scale, h0, *outs]
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("op", CAST_OPS)
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 1024), (1000, 4104)])
def test_cuda_many_blocks_publish_one_scale(device, op, shape):
    """Large grids on the GPU (hundreds of blocks racing on the slot): the scaled_max form
    equals update-then-cast bit for bit, on repeat, for an H[0] the amax kernel just wrote."""
    x = _x(shape, torch.bfloat16, device)
    results = []
    for fused in (True, False, True):
        torch.manual_seed(7)
        first, outs, tail = _cast_args(op, x, device, torch.float8_e4m3fn)
        scale, h0 = torch.ones(1, device=device), torch.zeros(1, device=device)
        scaled_max = torch.tensor([448.0], device=device)
        G.amax(x, h0)
        results.append(_cast_both_ways(op, x, first, outs, tail, scale, h0, scaled_max, fused))
    for other in results[1:]:
        for i, (a, b) in enumerate(zip(results[0], other, strict=True)):
            assert_bitwise_equal(a, b, f"{op} tensor {i}")
