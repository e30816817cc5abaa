"""The activations with a blockwise FP8 output (graphfp8.ops.blockwise_act, csrc/blockwise_act.h)
bit for bit against their twin (reference_blockwise.blockwise_act: torch's activation, then the
float64 tile-by-tile quantizer) and against the activation kernels they extend followed by the
blockwise quantizer's rule (gelu_cast_transpose / glu_cast_transpose give each tile's amax and
its bytes at the tile's scale): GELU, SwiGLU, GeGLU, partial last tiles (rows and F not
multiples of 128), zero tiles, bf16 / fp32 / fp16, both FP8 formats and scale rules; the argument
checks; on CUDA the same against the CUDA kernels and captured."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference, reference_blockwise
from graphfp8.ops.blockwise import scales_from_amax
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import HAS_CUDA, assert_outputs_equal

ACTS = ["gelu", "swiglu", "geglu"]
SHAPES = [(1, 128), (5, 300), (130, 256), (257, 129), (16, 1000), (256, 384)]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
NAMES = ("out", "scale_inv", "out_t", "scale_inv_t")
E4M3 = torch.float8_e4m3fn


def _case(shape, dtype, activation, seed=0):
    """x of a (rows, F) activation: a zero row, an outlier, and the first 128 columns of a zero
    in every row (GELU: x 0 there; gated: u 0) when F > 128."""
    gen = torch.Generator().manual_seed(seed)
    rows, f = shape
    width = f if activation == "gelu" else 2 * f
    x = torch.randn(rows, width, generator=gen) * 3
    x[0] = 0
    if rows > 2:
        x[2, f // 2] = 60.0
    if f > 128:
        zero_from = 0 if activation == "gelu" else f
        x[1:, zero_from : zero_from + 128] = 0
    return x.to(dtype)


def _run(x, activation, transpose, p2=True, fp8=E4M3):
    return ops.blockwise_act(x, activation, transpose=transpose, power_2_scale=p2, fp8_dtype=fp8)


def _twin(got, x, activation, p2=True):
    want = [None if t is None else torch.full_like(t, 7) for t in got]
    reference.blockwise_act(x, activation, *want, p2)
    return want


def _check(got, want, what: str) -> None:
    assert_outputs_equal(got, want, NAMES, what)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_kernel_equals_the_twin(shape, dtype, activation):
    x = _case(shape, dtype, activation)
    for transpose in (False, True):
        got = _run(x, activation, transpose)
        _check(got, _twin(got, x, activation), f"{activation} {shape} {dtype} {transpose}")


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("power_2_scale", [True, False])
def test_formats_and_scale_rules(activation, fp8_dtype, power_2_scale):
    x = _case((200, 260), torch.bfloat16, activation, seed=1)
    got = _run(x, activation, True, p2=power_2_scale, fp8=fp8_dtype)
    _check(got, _twin(got, x, activation, p2=power_2_scale), f"{fp8_dtype} {power_2_scale}")


def _inputs_of(x, activation, rows: slice, cols: slice) -> torch.Tensor:
    """The part of x that a[rows, cols] is computed from, as a contiguous x of its own."""
    if activation == "gelu":
        return x[rows, cols].contiguous()
    f = x.shape[1] // 2
    return torch.cat([x[rows, :f][:, cols], x[rows, f:][:, cols]], dim=1)


def _per_tensor(x, activation, scale, fp8):
    """The fused per-tensor activation kernel's FP8 a at `scale` and its amax (max |a|): on CUDA
    gelu_cast_transpose for GELU; on the CPU GeGLU's with u = 1, whose host tanh the blockwise
    op's CPU GELU takes (csrc/blockwise_act.h; the CPU GELU cast's tanhf differs in last bits)."""
    s = torch.full((1,), float(scale), device=x.device)
    amax = torch.zeros(1, device=x.device)
    if activation == "gelu" and x.device.type != "cpu":
        return ops.gelu_cast_transpose(x, s, amax, fp8)[0], amax
    if activation == "gelu":
        x, activation = torch.cat([x, torch.ones_like(x)], dim=1), "geglu"
    return ops.glu_cast_transpose(x, activation, s, amax, fp8)[0], amax


def _tiles(x, activation, f: int, transpose: bool, fp8, p2=True):
    """(out, scale_inv) of a's 1x128 tiles (of a.T's with transpose) as the activation kernel
    then the blockwise quantizer make them: each tile's amax is the per-tensor kernel's over the
    tile's inputs, its scale the quantizer's rule, its bytes the per-tensor kernel's at that
    scale (the per-tensor kernels write no high-precision a to quantize)."""
    rows = x.shape[0]
    lines, length = (f, rows) if transpose else (rows, f)
    amax = torch.empty(lines, -(-length // 128), device=x.device)
    for i in range(lines):
        for j in range(amax.shape[1]):
            span = slice(j * 128, (j + 1) * 128)
            part = (span, slice(i, i + 1)) if transpose else (slice(i, i + 1), span)
            amax[i, j] = _per_tensor(_inputs_of(x, activation, *part), activation, 1.0, fp8)[1][0]
    scale, scale_inv = scales_from_amax(amax, fp8, p2)
    per_element = scale.repeat_interleave(128, dim=1)[:, :length]
    out = torch.empty(lines, length, dtype=fp8, device=x.device)
    for s in per_element.unique():
        q = _per_tensor(x, activation, s, fp8)[0]
        q = q.t() if transpose else q
        out.view(torch.uint8)[per_element == s] = q.view(torch.uint8)[per_element == s]
    return out, scale_inv


def _kernel_then_quantize(x, activation, transpose, fp8=E4M3):
    f = x.shape[1] if activation == "gelu" else x.shape[1] // 2
    got = _tiles(x, activation, f, False, fp8)
    return got + (_tiles(x, activation, f, True, fp8) if transpose else (None, None))


@pytest.mark.parametrize("activation", ACTS)
def test_equals_the_activation_kernel_then_quantize(device, activation):
    """The fused op writes what the activation kernel and the quantizer write, on the device."""
    for shape in ((257, 129), (130, 300)):
        x = _case(shape, torch.bfloat16, activation, seed=2).to(device)
        for transpose in (True, False):
            got = _run(x, activation, transpose)
            _check(got, _kernel_then_quantize(x, activation, transpose), f"{shape}")


def test_zero_and_partial_tiles():
    """A zero tile scales by 1 (and writes zeros); a partial tile takes its amax over the
    elements it has."""
    x = torch.zeros(3, 2 * 200)
    x[1, :200] = 30.0  # u 0: a zero row
    x[2, :150] = 30.0  # silu(30) = 30 in float32
    x[2, 200:350] = 1.0
    o = _run(x, "swiglu", True)
    assert o.scale_inv[:2].eq(1.0).all() and not o.out[:2].float().any()
    assert o.scale_inv[2].tolist() == [1 / 8, 1 / 8]  # 448 / 30 -> 2^3; the partial tile too
    assert torch.equal(o.out[2, :150].float(), torch.full((150,), 240.0))
    assert not o.out[2, 150:].float().any()
    assert o.scale_inv_t[:150].eq(1 / 8).all() and o.scale_inv_t[150:].eq(1.0).all()


def test_argument_checks():
    x = _case((4, 256), torch.bfloat16, "swiglu")
    o = _run(x, "swiglu", True)
    op = torch.ops.graphfp8.blockwise_act
    with pytest.raises(RuntimeError, match="'activation' must be 'gelu', 'swiglu' or 'geglu'"):
        op(x, "relu", o.out, o.scale_inv)
    with pytest.raises(RuntimeError, match="must have an even width"):
        op(x[:, :255].contiguous(), "geglu", o.out, o.scale_inv)
    with pytest.raises(RuntimeError, match=r"'out' must have shape \[4, 512\]"):
        op(x, "gelu", o.out, o.scale_inv)
    with pytest.raises(RuntimeError, match="'scale_inv' must have shape"):
        op(x, "swiglu", o.out, o.scale_inv_t)
    with pytest.raises(RuntimeError, match="'out_t' and 'scale_inv_t' together"):
        op(x, "swiglu", o.out, o.scale_inv, o.out_t)
    with pytest.raises(ValueError, match="activation must be one of"):
        _run(x, "relu", False)
    with pytest.raises(ValueError, match="must be 2-D"):
        _run(x[None], "gelu", False)


def test_twin_activation_is_the_layers():
    """The twin's activation is the per-tensor GLU kernels' on the CPU (their FP8 bytes at
    scale 1 from it): the twin stands for the activation kernel, not for another GELU or SiLU."""
    for activation in ACTS:
        x = _case((64, 300), torch.bfloat16, activation, seed=4)
        a = reference_blockwise.act_values(x, activation)
        q, amax = _per_tensor(x, activation, 1.0, E4M3)
        assert_bitwise_equal(q, a.float().clamp(-448, 448).to(E4M3), activation)
        assert amax.item() == a.float().abs().max().item()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_cuda_equals_the_activation_kernel_then_quantize(dtype, activation):
    """The CUDA kernel (vector and scalar paths, whole and partial tiles) against the CUDA
    activation kernel then the quantizer's rule: the same bytes and scales."""
    for shape in ((384, 512), (257, 129), (1, 300), (130, 1000)):
        x = _case(shape, dtype, activation, seed=3).cuda()
        for transpose in (True, False):
            got = _run(x, activation, transpose)
            _check(got, _kernel_then_quantize(x, activation, transpose), f"{shape}")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("activation", ACTS)
def test_cuda_in_a_cuda_graph(activation):
    x = _case((512, 1024), torch.bfloat16, activation).cuda()
    _run(x, activation, True)  # warm up the launches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _run(x, activation, True)
    x.mul_(2)
    graph.replay()
    _check(got, _run(x, activation, True), "replay")
