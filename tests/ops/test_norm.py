"""The norms with an FP8 output (layernorm_fp8, rmsnorm_fp8) and their backward against their
twins: bit for bit on the CPU; within the rounding of fp32 tree sums on the GPU (its mu and
rsigma come from other summation orders; given those, every elementwise step is the same); and
against torch's float64 LayerNorm / RMSNorm and autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from graphfp8 import ops, reference
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import FP8_DTYPES, HP_DTYPES, poison

# One row, one column, odd hidden sizes (not a multiple of any vector width), vector shapes.
SHAPES = [(1, 1), (1, 64), (5, 33), (37, 53), (16, 1001), (48, 256), (130, 96)]
NORMS = ["LayerNorm", "RMSNorm"]
_ONE_STEP = {torch.float8_e4m3fn: 2.0**-3, torch.float8_e5m2: 2.0**-2}


def _params(hidden, dtype, zero_centered):
    gamma = torch.randn(hidden) * (0.2 if zero_centered else 1.0) + (0.0 if zero_centered else 1)
    return gamma.to(dtype), (torch.randn(hidden) * 0.5).to(dtype)


def _fwd_inputs(shape, dtype, *, residual=False, specials=False, zero_centered=False):
    x = (torch.randn(shape) * 3 + torch.randn(shape[0], 1) * 2).to(dtype)
    if specials and shape[0] >= 3:
        x[0, 0], x[1, -1] = math.nan, math.inf
    res = (torch.randn(shape) * 2).to(dtype) if residual else None
    gamma, beta = _params(shape[1], dtype, zero_centered)
    scale = torch.empty(1).uniform_(0.5, 8.0)
    return x, res, gamma, beta, scale, torch.empty(1).uniform_(0.0, 0.5)


def _run_fwd(fn, norm, args, fp8_dtype, device, *, transpose, hp_out, zero_centered, eps=1e-5):
    """Calls the op (or its twin) with fresh poisoned outputs on `device`; returns the outputs
    as CPU tensors, named."""
    x, res, gamma, beta, scale, amax0 = (a.to(device) if a is not None else None for a in args)
    rows, hidden = x.shape
    out = {
        "out": poison(torch.empty(rows, hidden, dtype=fp8_dtype, device=device)),
        "out_t": poison(torch.empty(hidden, rows, dtype=fp8_dtype, device=device))
        if transpose else None,
        "scale_inv": torch.full((1,), 7.0, device=device),
        "amax": amax0.clone(),
        "mu": poison(torch.empty(rows, device=device)) if norm == "LayerNorm" else None,
        "rsigma": poison(torch.empty(rows, device=device)),
        "out_hp": poison(torch.empty_like(x)) if hp_out else None,
        "residual_out": poison(torch.empty_like(x)) if res is not None else None,
    }  # fmt: skip
    tail = [out["out_hp"], res, out["residual_out"]]
    if norm == "LayerNorm":
        fn(x, gamma, beta, eps, zero_centered, scale, out["out"], out["out_t"], out["scale_inv"],
           out["amax"], out["mu"], out["rsigma"], *tail)  # fmt: skip
    else:
        fn(x, gamma, eps, zero_centered, scale, out["out"], out["out_t"], out["scale_inv"],
           out["amax"], out["rsigma"], *tail)  # fmt: skip
    return {k: v.cpu() for k, v in out.items() if v is not None}


def _op(name):
    return getattr(torch.ops.graphfp8, name), getattr(reference, name)


def _assert_fp8_close(got, want, slack):
    """Equal except on at most 2% of the elements, each within one FP8 step plus `slack`
    (relative) of the twin."""
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    assert differ.float().mean().item() <= 0.02, f"{int(differ.sum())} FP8 values differ"
    g, w = got.double(), want.double()
    close = (g - w).abs() <= (_ONE_STEP[got.dtype] + slack) * w.abs() + 2.0**-9
    ok = close | (g.isnan() & w.isnan())
    assert bool(ok.all()), "an FP8 value is off by more than one step"


def _compare_fwd(got, want, device):
    if device == "cpu":
        for name in want:
            assert_bitwise_equal(got[name], want[name], name)
        return
    assert_bitwise_equal(got["scale_inv"], want["scale_inv"], "scale_inv")
    if "residual_out" in want:  # an elementwise add: the same on every device but NaN bits
        # (CUDA writes the hardware's canonical NaN, the CPU twin c10's; vec.cuh's to_bits)
        torch.testing.assert_close(got["residual_out"], want["residual_out"], rtol=0, atol=0,
                                   equal_nan=True, msg="residual_out")  # fmt: skip
    for name in ("mu", "rsigma"):
        if name in want:
            torch.testing.assert_close(got[name], want[name], rtol=2e-6, atol=2e-6, equal_nan=True)
    _assert_fp8_close(got["out"], want["out"], 1e-5)
    if "out_t" in want:
        assert_bitwise_equal(got["out_t"], got["out"].t().contiguous(), "out_t is out.T")
    torch.testing.assert_close(got["amax"], want["amax"], rtol=1e-5, atol=0.0)
    if "out_hp" in want:
        eps = torch.finfo(want["out_hp"].dtype).eps
        torch.testing.assert_close(got["out_hp"].float(), want["out_hp"].float(), rtol=2 * eps,
                                   atol=1e-5, equal_nan=True)  # fmt: skip


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_twin(device, norm, hp_dtype, fp8_dtype, shape):
    name = "layernorm_fp8" if norm == "LayerNorm" else "rmsnorm_fp8"
    op, twin = _op(name)
    args = _fwd_inputs(shape, hp_dtype, specials=True)
    kw = dict(transpose=True, hp_out=True, zero_centered=False)
    got = _run_fwd(op, norm, args, fp8_dtype, device, **kw)
    want = _run_fwd(twin, norm, args, fp8_dtype, "cpu", **kw)
    _compare_fwd(got, want, device)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize(
    "transpose, hp_out, residual, zero_centered",
    [(False, False, False, False), (True, False, True, True), (False, True, True, False)],
)
def test_forward_options_match_twin(device, norm, hp_dtype, transpose, hp_out, residual,
                                    zero_centered):  # fmt: skip
    name = "layernorm_fp8" if norm == "LayerNorm" else "rmsnorm_fp8"
    op, twin = _op(name)
    args = _fwd_inputs((48, 80), hp_dtype, residual=residual, zero_centered=zero_centered)
    kw = dict(transpose=transpose, hp_out=hp_out, zero_centered=zero_centered)
    got = _run_fwd(op, norm, args, torch.float8_e4m3fn, device, **kw)
    want = _run_fwd(twin, norm, args, torch.float8_e4m3fn, "cpu", **kw)
    _compare_fwd(got, want, device)


def _bwd_inputs(norm, shape, dtype, zero_centered, dresidual):
    x, _, gamma, beta, scale, amax = _fwd_inputs(shape, dtype, zero_centered=zero_centered)
    fwd = (ops.layernorm_fp8(x, gamma, beta, 1e-5, scale, amax, torch.float8_e4m3fn)
           if norm == "LayerNorm" else
           ops.rmsnorm_fp8(x, gamma, 1e-5, scale, amax, torch.float8_e4m3fn))  # fmt: skip
    dy = (torch.randn(shape) * 4).to(dtype)
    dres = (torch.randn(shape)).to(dtype) if dresidual else None
    return dy, x, fwd.mu, fwd.rsigma, gamma, dres


def _run_bwd(fn, norm, args, device, zero_centered):
    dy, x, mu, rsigma, gamma, dres = (a.to(device) if a is not None else None for a in args)
    dx, dgamma = poison(torch.empty_like(x)), poison(torch.empty_like(gamma))
    if norm == "LayerNorm":
        dbeta = poison(torch.empty_like(gamma))
        fn(dy, x, mu, rsigma, gamma, zero_centered, dx, dgamma, dbeta, dres)
        return {"dx": dx.cpu(), "dgamma": dgamma.cpu(), "dbeta": dbeta.cpu()}
    fn(dy, x, rsigma, gamma, zero_centered, dx, dgamma, dres)
    return {"dx": dx.cpu(), "dgamma": dgamma.cpu()}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(0, 40)])
@pytest.mark.parametrize("zero_centered, dresidual", [(False, False), (True, True)])
def test_backward_matches_twin(device, norm, hp_dtype, shape, zero_centered, dresidual):
    name = "layernorm_bwd" if norm == "LayerNorm" else "rmsnorm_bwd"
    op, twin = _op(name)
    args = _bwd_inputs(norm, shape, hp_dtype, zero_centered, dresidual)
    got = _run_bwd(op, norm, args, device, zero_centered)
    want = _run_bwd(twin, norm, args, "cpu", zero_centered)
    for k in want:
        if device == "cpu":
            assert_bitwise_equal(got[k], want[k], k)
        else:
            # fp32 tree sums over a row (dx) or over the rows (dgamma, dbeta) instead of float64
            # sequential ones: a few fp32 ulps of the largest terms, then one rounding.
            eps = torch.finfo(hp_dtype).eps
            scale = want[k].float().abs().amax().item() if want[k].numel() else 0.0
            torch.testing.assert_close(got[k].float(), want[k].float(), rtol=2 * eps,
                                       atol=1e-4 * scale + 1e-6)  # fmt: skip


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_against_torch_float64(device, norm, zero_centered):
    """The float32 forward (high-precision output) and backward against torch's own norm and
    autograd in float64."""
    x, _, gamma, beta, scale, amax = _fwd_inputs((64, 96), torch.float32,
                                                 zero_centered=zero_centered)  # fmt: skip
    x, gamma, beta, scale, amax = (t.to(device) for t in (x, gamma, beta, scale, amax))
    dy = torch.randn(64, 96, device=device)
    x64, g64, b64 = (t.double().requires_grad_() for t in (x, gamma, beta))
    w64 = g64 + 1 if zero_centered else g64
    if norm == "LayerNorm":
        y64 = F.layer_norm(x64, (96,), w64, b64, 1e-5)
        o = ops.layernorm_fp8(x, gamma, beta, 1e-5, scale, amax, torch.float8_e4m3fn,
                              zero_centered_gamma=zero_centered, hp_out=True)  # fmt: skip
        grads = ops.layernorm_bwd(dy, x, o.mu, o.rsigma, gamma, zero_centered_gamma=zero_centered)
        y64.backward(dy.double())
        want = (x64.grad, g64.grad, b64.grad)
    else:
        y64 = F.rms_norm(x64, (96,), w64, 1e-5)
        o = ops.rmsnorm_fp8(x, gamma, 1e-5, scale, amax, torch.float8_e4m3fn,
                            zero_centered_gamma=zero_centered, hp_out=True)  # fmt: skip
        grads = ops.rmsnorm_bwd(dy, x, o.rsigma, gamma, zero_centered_gamma=zero_centered)
        y64.backward(dy.double())
        want = (x64.grad, g64.grad)
    torch.testing.assert_close(o.out_hp.double(), y64.detach(), rtol=1e-5, atol=1e-5)
    for got, w in zip(grads, want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-4)
    # The FP8 output is the high-precision one, quantized.
    want_fp8 = reference.quantize(o.out_hp.float(), scale, torch.float8_e4m3fn)
    _assert_fp8_close(o.out.cpu(), want_fp8.cpu(), 1e-6)


def test_backward_is_deterministic(device):
    x, _, gamma, beta, scale, amax = _fwd_inputs((300, 512), torch.bfloat16)
    x, gamma, beta, scale, amax = (t.to(device) for t in (x, gamma, beta, scale, amax))
    o = ops.layernorm_fp8(x, gamma, beta, 1e-5, scale, amax, torch.float8_e4m3fn)
    dy = torch.randn_like(x)
    first = ops.layernorm_bwd(dy, x, o.mu, o.rsigma, gamma)
    for _ in range(3):
        for a, b in zip(ops.layernorm_bwd(dy, x, o.mu, o.rsigma, gamma), first, strict=True):
            assert_bitwise_equal(a, b)


def test_amax_ignores_nan_and_keeps_larger_prior():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [math.nan, 0.0, 1.0, 2.0]])
    gamma, beta = torch.ones(4), torch.zeros(4)
    amax = torch.tensor([100.0])
    o = ops.layernorm_fp8(x, gamma, beta, 1e-5, torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == 100.0
    assert o.out[1].view(torch.uint8).tolist() == [0x7F] * 4  # a NaN row is NaN throughout
    amax.zero_()
    ops.layernorm_fp8(x[:1], gamma, beta, 1e-5, torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == pytest.approx(1.3416, abs=1e-3)  # (4 - 2.5) / sqrt(1.25)


def _fwd_kwargs(device="cpu", rows=8, hidden=16):
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=device)
    return dict(
        x=x, gamma=torch.ones(hidden, dtype=torch.bfloat16, device=device),
        beta=torch.zeros(hidden, dtype=torch.bfloat16, device=device), eps=1e-5,
        zero_centered_gamma=False, scale=torch.ones(1, device=device),
        out=torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=device), out_t=None,
        scale_inv=torch.empty(1, device=device), amax=torch.zeros(1, device=device),
        mu=torch.empty(rows, device=device), rsigma=torch.empty(rows, device=device),
    )  # fmt: skip


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(x=torch.randn(8, 16)), r"'gamma' must have the dtype of 'x'"),
        (dict(x=torch.randn(8, 16, dtype=torch.bfloat16).t()), r"'x' must be contiguous"),
        (dict(x=torch.randn(2, 8, 16, dtype=torch.bfloat16)), r"'x' must be 2-D"),
        (dict(x=torch.empty(8, 0, dtype=torch.bfloat16)), r"hidden size must be at least 1"),
        (dict(gamma=torch.ones(15, dtype=torch.bfloat16)), r"'gamma' must have shape \[16\]"),
        (dict(beta=torch.zeros(16)), r"'beta' must have the dtype of 'x'"),
        (dict(eps=-1.0), r"eps must be finite and >= 0"),
        (dict(out=torch.empty(8, 16, dtype=torch.bfloat16)), r"'out' must be float8"),
        (dict(out_t=torch.empty(8, 16, dtype=torch.float8_e4m3fn)), r"'out_t' must have shape"),
        (dict(mu=torch.empty(7)), r"'mu' must have shape \[8\]"),
        (dict(rsigma=torch.empty(8, dtype=torch.float64)), r"'rsigma' must be float32"),
        (dict(residual=torch.zeros(8, 16, dtype=torch.bfloat16)),
         r"'residual' and 'residual_out' go together"),
        (dict(residual=torch.zeros(8, 16), residual_out=torch.zeros(8, 16)),
         r"'residual' must have the dtype of 'x'"),
        (dict(out_hp=torch.empty(8, 15, dtype=torch.bfloat16)), r"'out_hp' must have shape"),
    ],
)  # fmt: skip
def test_forward_bad_arguments(change, pattern):
    kw = {**_fwd_kwargs(), **change}
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.graphfp8.layernorm_fp8(**kw)


def test_backward_bad_arguments():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    g, stats = torch.ones(16, dtype=torch.bfloat16), torch.ones(8)
    op = torch.ops.graphfp8.layernorm_bwd
    with pytest.raises(RuntimeError, match=r"'dy' must have shape \[8, 16\]"):
        op(x[:4], x, stats, stats, g, False, torch.empty_like(x), g.clone(), g.clone())
    with pytest.raises(RuntimeError, match=r"'dbeta' must have the dtype of 'x'"):
        op(x, x, stats, stats, g, False, torch.empty_like(x), g.clone(), g.float())
    with pytest.raises(RuntimeError, match=r"'dresidual' must have shape"):
        op(x, x, stats, stats, g, False, torch.empty_like(x), g.clone(), g.clone(), x[:4])
    with pytest.raises(RuntimeError, match=r"'mu' must be float32"):
        op(x, x, stats.half(), stats, g, False, torch.empty_like(x), g.clone(), g.clone())
    with pytest.raises(ValueError, match=r"'x' must be 2-D"):
        ops.rmsnorm_fp8(x[None], g, 1e-5, torch.ones(1), torch.zeros(1), torch.float8_e4m3fn)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_hidden_limit_and_devices():
    kw = _fwd_kwargs("cuda", rows=2, hidden=8200)
    with pytest.raises(RuntimeError, match=r"hidden size of at most 8192, got 8200"):
        torch.ops.graphfp8.layernorm_fp8(**kw)
    kw = _fwd_kwargs("cuda")
    kw["gamma"] = kw["gamma"].cpu()
    with pytest.raises(RuntimeError, match=r"'gamma' is on cpu but the input is on cuda"):
        torch.ops.graphfp8.layernorm_fp8(**kw)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize(
    "shape, hp_dtype",
    [((2048, 4096), torch.bfloat16), ((1100, 8192), torch.bfloat16), ((777, 2048), torch.float32),
     ((3000, 1536), torch.float16), ((513, 8190), torch.bfloat16)],
)  # fmt: skip
def test_cuda_large_shapes_match_twin_and_repeat(norm, shape, hp_dtype):
    """The GPU paths the small shapes miss: rows spread over several warps (cross-warp sums),
    16-byte loads, more rows than the backward's 256 blocks hold at once (a grid-stride loop
    over row groups), an unvectorised hidden size near the limit. Against the twin within the
    GPU's summation-order tolerance, and the backward bit-identical on a second run."""
    fwd_name, bwd_name = ("layernorm_fp8", "layernorm_bwd") if norm == "LayerNorm" else \
        ("rmsnorm_fp8", "rmsnorm_bwd")  # fmt: skip
    op, twin = _op(fwd_name)
    args = _fwd_inputs(shape, hp_dtype, residual=True, specials=True)
    kw = dict(transpose=True, hp_out=True, zero_centered=False)
    got = _run_fwd(op, norm, args, torch.float8_e4m3fn, "cuda", **kw)
    want = _run_fwd(twin, norm, args, torch.float8_e4m3fn, "cpu", **kw)
    _compare_fwd(got, want, "cuda")
    bwd_op, bwd_twin = _op(bwd_name)
    bwd_args = _bwd_inputs(norm, shape, hp_dtype, False, True)
    got = _run_bwd(bwd_op, norm, bwd_args, "cuda", False)
    again = _run_bwd(bwd_op, norm, bwd_args, "cuda", False)
    want = _run_bwd(bwd_twin, norm, bwd_args, "cpu", False)
    for k in want:
        assert_bitwise_equal(got[k], again[k], f"{k}, second run")
        eps = torch.finfo(hp_dtype).eps
        scale = want[k].float().abs().amax().item()
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=2 * eps,
                                   atol=1e-4 * scale + 1e-6)  # fmt: skip
