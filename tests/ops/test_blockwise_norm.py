"""The norm with a blockwise FP8 output (graphfp8.ops.blockwise_norm, csrc/blockwise_norm.h) bit
for bit against its twin (reference.blockwise_norm: the norm's high-precision output quantized
in 1x128 tiles) and against the package's own two kernels run one after the other (the norm
with hp_out, then blockwise_quantize): LayerNorm and RMSNorm, partial last tiles (rows and
hidden not multiples of 128), zero tiles, a residual add, zero-centred gamma, bf16 / fp32 / fp16,
both scale rules; the argument checks; on CUDA the same against the CUDA kernels and captured."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from tests.helpers import HAS_CUDA, assert_outputs_equal

SHAPES = [(1, 128), (5, 300), (130, 256), (257, 129), (16, 1000), (256, 384)]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
NAMES = ("out", "scale_inv", "out_t", "scale_inv_t", "mu", "rsigma", "residual_out")


def _case(shape, dtype, layernorm: bool, seed=0):
    """x with a zero row (RMSNorm: a zero tile of y) and an outlier row; gamma with its first
    128 columns zero (a zero tile in every row) and one large weight."""
    gen = torch.Generator().manual_seed(seed)
    rows, hidden = shape
    x = torch.randn(shape, generator=gen) * 3
    x[0] = 0
    if rows > 2:
        x[2, hidden // 2] = 500.0
    gamma = torch.randn(hidden, generator=gen)
    if hidden > 128:
        gamma[:128] = 0
    gamma[-1] = 40.0
    beta = torch.randn(hidden, generator=gen) * 0.1 if layernorm else None
    res = torch.randn(shape, generator=gen)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(x), cast(gamma), cast(beta), cast(res)


def _run(x, gamma, beta, residual, transpose, zcg=False, p2=True, fp8=torch.float8_e4m3fn):
    return ops.blockwise_norm(
        x,
        gamma,
        beta,
        1e-5,
        zero_centered_gamma=zcg,
        transpose=transpose,
        residual=residual,
        power_2_scale=p2,
        fp8_dtype=fp8,
    )


def _twin(got, x, gamma, beta, residual, zcg=False, p2=True):
    """reference.blockwise_norm into fresh outputs shaped like the kernel's."""
    want = [None if t is None else torch.full_like(t, 7) for t in got]
    reference.blockwise_norm(
        x,
        gamma,
        beta,
        1e-5,
        zcg,
        want[0],
        want[1],
        want[2],
        want[3],
        want[4],
        want[5],
        residual,
        want[6],
        p2,
    )
    return want


def _check(got, want, what: str) -> None:
    assert_outputs_equal(got, want, NAMES, what)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layernorm", [True, False])
def test_kernel_equals_the_twin(shape, dtype, layernorm):
    x, gamma, beta, _ = _case(shape, dtype, layernorm)
    for transpose in (False, True):
        got = _run(x, gamma, beta, None, transpose)
        _check(got, _twin(got, x, gamma, beta, None), f"{shape} {dtype} {transpose}")


@pytest.mark.parametrize("layernorm", [True, False])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("power_2_scale", [True, False])
def test_residual_gamma_formats_and_scale_rules(layernorm, fp8_dtype, power_2_scale):
    x, gamma, beta, res = _case((200, 260), torch.bfloat16, layernorm, seed=1)
    for residual in (None, res):
        got = _run(x, gamma, beta, residual, True, zcg=True, p2=power_2_scale, fp8=fp8_dtype)
        want = _twin(got, x, gamma, beta, residual, zcg=True, p2=power_2_scale)
        _check(got, want, f"residual {residual is not None}")


def _norm_then_quantize(x, gamma, beta, residual, transpose):
    """The unfused path: the norm kernel's high-precision output, then the blockwise quantizer."""
    one, amax = torch.ones(1, device=x.device), torch.zeros(1, device=x.device)
    kw = dict(hp_out=True, residual=residual)
    if beta is not None:
        n = ops.layernorm_fp8(x, gamma, beta, 1e-5, one, amax, torch.float8_e4m3fn, **kw)
    else:
        n = ops.rmsnorm_fp8(x, gamma, 1e-5, one, amax, torch.float8_e4m3fn, **kw)
    q = ops.blockwise_quantize(n.out_hp, 1, transpose=transpose)
    return (*q, *((None, None) if not transpose else ()), n.mu, n.rsigma, n.residual_out)


@pytest.mark.parametrize("layernorm", [True, False])
def test_equals_norm_then_quantize(device, layernorm):
    """The fused op writes what the two kernels it replaces write, on the device it runs on."""
    for shape in ((257, 129), (384, 512), (64, 1000)):
        x, gamma, beta, res = (
            None if t is None else t.to(device)
            for t in _case(shape, torch.bfloat16, layernorm, seed=2)
        )
        for residual, transpose in ((None, True), (res, True), (res, False)):
            got = _run(x, gamma, beta, residual, transpose)
            _check(got, _norm_then_quantize(x, gamma, beta, residual, transpose), f"{shape}")


def test_zero_and_partial_tiles():
    """A zero tile scales by 1 (and writes zeros); a partial tile takes its amax over the
    elements it has."""
    x = torch.zeros(3, 200)
    x[1] = 1.0
    x[2, :150] = 2.0  # RMSNorm: y = x / rms(x)
    gamma = torch.ones(200)
    o = _run(x, gamma, None, None, True)
    assert o.scale_inv[0].tolist() == [1.0, 1.0] and not o.out[0].float().any()
    assert torch.equal(o.out[1].float(), torch.full((200,), 256.0))  # 448 -> 2^8, y = 1
    assert o.scale_inv_t[160:].eq(1 / 256).all()  # column tiles of y.T: rows 1 (y 1) and 2 (0)


def test_argument_checks():
    x, gamma, beta, res = _case((4, 256), torch.bfloat16, True)
    o = _run(x, gamma, beta, None, True)
    op = torch.ops.graphfp8.blockwise_norm
    with pytest.raises(RuntimeError, match="give 'mu' with 'beta'"):
        op(x, gamma, beta, 1e-5, False, o.out, o.scale_inv, None, None, None, o.rsigma)
    with pytest.raises(RuntimeError, match="'scale_inv' must have shape"):
        op(x, gamma, beta, 1e-5, False, o.out, o.scale_inv_t, None, None, o.mu, o.rsigma)
    with pytest.raises(RuntimeError, match="'out_t' and 'scale_inv_t' together"):
        op(x, gamma, beta, 1e-5, False, o.out, o.scale_inv, o.out_t, None, o.mu, o.rsigma)
    with pytest.raises(RuntimeError, match="'gamma' must have the dtype"):
        _run(x, gamma.float(), beta, None, False)
    with pytest.raises(ValueError, match="must be 2-D"):
        _run(x[None], gamma, beta, None, False)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layernorm", [True, False])
def test_cuda_equals_norm_then_quantize(dtype, layernorm):
    """The CUDA kernels (vector and scalar paths, whole and partial tiles, a residual) against
    the CUDA norm (hp_out) then the CUDA blockwise quantizer: the same bytes, mu and rsigma."""
    for shape in ((1024, 2048), (384, 256), (257, 129), (1, 300), (130, 1000), (4096, 4096)):
        x, gamma, beta, res = (
            None if t is None else t.cuda() for t in _case(shape, dtype, layernorm, seed=3)
        )
        for residual, transpose in ((None, True), (res, True), (None, False)):
            got = _run(x, gamma, beta, residual, transpose)
            _check(got, _norm_then_quantize(x, gamma, beta, residual, transpose), f"{shape}")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_in_a_cuda_graph():
    x, gamma, beta, _ = (t.cuda() for t in _case((512, 1024), torch.bfloat16, True))
    _run(x, gamma, beta, None, True)  # warm up the launches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _run(x, gamma, beta, None, True)
    x.mul_(2)
    graph.replay()
    _check(got, _norm_then_quantize(x, gamma, beta, None, True), "replay")
