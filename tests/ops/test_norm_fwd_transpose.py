"""The norm forward writing both FP8 layouts from one kernel (kernel switch NORM_FWD_TRANSPOSE,
csrc/cuda/norm_fwd.cu's band kernel) against the kernel and transpose pass it replaces: out,
out_t, amax, scale_inv, mu, rsigma, the high-precision output and the residual sum bit for bit,
on every path (LayerNorm and RMSNorm, each dtype, both FP8 formats, residual, hp_out,
zero-centred gamma, current scaling's scaled_max form, bands wider than 16 rows, a last band
cut short, the shapes that fall back to the second pass), on repeat, in a CUDA graph, and in
layers trained for three steps. The CPU kernel writes both layouts in its one loop whatever the
switch says (csrc/cpu/norm.cpp): the cpu cases check that the switch leaves it alone."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8 import ops
from graphfp8.ops.switches import SWITCHES, kernel_switch, switch_on
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import CUDA_PARAM
from tests.modules.common import fp8_state

SWITCH = "NORM_FWD_TRANSPOSE"
SHAPES = [
    ((8192, 1024), torch.bfloat16),  # the 100m preset's norms: 32 lanes per row, bands of 16
    ((4096, 2048), torch.bfloat16),  # llama-1b's width
    ((1008, 2944), torch.bfloat16),  # the widest band in 47 KB; rows not a multiple of the grid
    ((1040, 64), torch.bfloat16),  # 128 rows per block: bands of 128, the last one cut short
    ((3008, 1536), torch.float16),
    ((1024, 768), torch.float32),
    ((2048, 4096), torch.bfloat16),  # too wide for the band: the second pass
    ((1008, 3064), torch.bfloat16),  # the band and the block's scratch pass 48 KB: second pass
    ((777, 2048), torch.float32),  # rows not a multiple of 16: the second pass
    ((48, 1001), torch.bfloat16),  # no 16-byte loads: the second pass
]
# (rms, residual, hp_out, zero_centered, current)
OPTIONS = [
    (False, False, False, False, False),
    (True, True, False, False, False),
    (False, True, True, True, False),
    (True, False, True, False, True),
    (False, False, False, True, True),
]


def _inputs(shape, dtype, device, residual, zero_centered):
    rows, hidden = shape
    g = torch.Generator().manual_seed(rows * 7 + hidden)
    x = (torch.randn(shape, generator=g) * 3 + torch.randn(rows, 1, generator=g)).to(dtype)
    res = (torch.randn(shape, generator=g) * 2).to(dtype) if residual else None
    base = 0.0 if zero_centered else 1.0
    gamma = (torch.randn(hidden, generator=g) * 0.2 + base).to(dtype)
    beta = (torch.randn(hidden, generator=g) * 0.5).to(dtype)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(res), move(gamma), move(beta)


def _norm(inputs, fp8_dtype, rms, hp_out, zero_centered, current):
    """One forward with fresh scale / amax (current scaling writes the scale and resets H[0]);
    every output and the slot's state after it."""
    x, res, gamma, beta = inputs
    scale = torch.full((1,), 0.75, device=x.device)
    amax = torch.full((1,), 2.5 if current else 0.125, device=x.device)
    scaled_max = torch.full((1,), 448.0, device=x.device) if current else None
    kw = dict(zero_centered_gamma=zero_centered, transpose=True, hp_out=hp_out, residual=res)
    if rms:
        o = ops.rmsnorm_fp8(x, gamma, 1e-5, scale, amax, fp8_dtype, scaled_max, **kw)
    else:
        o = ops.layernorm_fp8(x, gamma, beta, 1e-5, scale, amax, fp8_dtype, scaled_max, **kw)
    named = {name: t for name, t in o._asdict().items() if t is not None}
    return {**named, "scale": scale, "amax": amax}


def _assert_same(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{what}: {name}")


def test_switch_is_known_and_off_by_default():
    """Off until the CUDA suite has run it on a GPU (tests/data/gpu_verified_switches.json)."""
    assert SWITCH in SWITCHES
    assert not switch_on(SWITCH)


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
@pytest.mark.parametrize("shape, dtype", SHAPES)
@pytest.mark.parametrize("rms, residual, hp_out, zero_centered, current", OPTIONS)
def test_transpose_in_kernel_equals_second_pass(device, shape, dtype, rms, residual, hp_out,
                                                zero_centered, current):  # fmt: skip
    if device == "cpu" and shape[0] * shape[1] > 2**20:
        pytest.skip("the CPU loop at this size adds nothing")
    inputs = _inputs(shape, dtype, device, residual, zero_centered)
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        args = (inputs, fp8_dtype, rms, hp_out, zero_centered, current)
        with kernel_switch(SWITCH, False):
            want = _norm(*args)
        with kernel_switch(SWITCH, True):
            got, again = _norm(*args), _norm(*args)
        what = f"{shape} {dtype} {fp8_dtype}"
        _assert_same(got, want, what)
        _assert_same(again, want, what + " (repeat)")
        assert_bitwise_equal(got["out_t"], got["out"].t().contiguous(), "out_t is out.T")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rms", [False, True])
def test_transpose_in_kernel_in_a_cuda_graph(rms):
    """Captured under the switch and replayed on new inputs: the eager two-pass outputs."""
    shape, dtype = (8192, 1024), torch.bfloat16
    x, res, gamma, beta = _inputs(shape, dtype, "cuda", True, False)
    scale = torch.full((1,), 0.75, device="cuda")
    amax = torch.zeros(1, device="cuda")

    def run():
        kw = dict(transpose=True, residual=res)
        if rms:
            return ops.rmsnorm_fp8(x, gamma, 1e-5, scale, amax, torch.float8_e4m3fn, **kw)
        return ops.layernorm_fp8(x, gamma, beta, 1e-5, scale, amax, torch.float8_e4m3fn, **kw)

    with kernel_switch(SWITCH, True):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
    x.copy_(torch.randn(shape, device="cuda").to(dtype) * 2)
    amax.zero_()
    graph.replay()
    torch.cuda.synchronize()
    got = {name: t.clone() for name, t in captured._asdict().items() if t is not None}
    got["amax"] = amax.clone()
    amax.zero_()
    with kernel_switch(SWITCH, False):
        want = {name: t for name, t in run()._asdict().items() if t is not None}
    want["amax"] = amax
    _assert_same(got, want, "graph replay")


def _train_steps(kind: str, recipe, on: bool):
    """Three forward / backward passes of a fresh layer (the same seed) under fp8_autocast with
    the switch `on`: outputs, input and parameter gradients, FP8 histories and scales."""
    torch.manual_seed(0)
    kw = dict(params_dtype=torch.bfloat16, device="cuda")
    if kind == "LayerNormMLP":
        m = g8.LayerNormMLP(1024, 4096, **kw)
    else:  # Llama's: RMSNorm, zero-centred gamma, no bias
        m = g8.LayerNormLinear(1024, 3072, normalization="RMSNorm", zero_centered_gamma=True,
                               bias=False, **kw)  # fmt: skip
    got = []
    with kernel_switch(SWITCH, on):
        for _ in range(3):
            x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with g8.fp8_autocast(recipe=recipe):
                y = m(x)
            y.backward(torch.randn_like(y))
            got += [y.detach(), x.grad]
    got += [p.grad for p in m.parameters()]
    return got + [t for _, t in fp8_state(m)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["LayerNormMLP", "RMSNormLinear"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_layers_train_the_same_bits(kind, scaling):
    """The path users take: a layer's norm feeding its FP8 GEMM, whose weight gradient reads the
    transposed layout; three steps with the switch on equal three with it off, bit for bit."""
    recipe = g8.DelayedScaling() if scaling == "delayed" else g8.Float8CurrentScaling()
    want = _train_steps(kind, recipe, False)
    got = _train_steps(kind, recipe, True)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"{kind} {scaling}: tensor {i}")
