"""The fused GLU kernels (SwiGLU, GeGLU + FP8 cast-transpose, and their backward + dbias) against
their twins, and the GLU math against torch's activations.

On the CPU the kernels equal the twins bit for bit: FP8 outputs, amax, scale_inv and dbias (both
compute exp and tanh in float64 and sum dbias sequentially in float64). On the GPU the
transcendentals are CUDA's float ones (within 2 ulp) and dbias sums tile partials in fp32, so the
FP8 outputs may move by one step on at most 1% of the elements and dbias is checked against a
float64 sum with an fp32 accumulation bound, as for the GELU kernels (tests/ops/test_cast_fused.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphfp8 import ops, reference
from graphfp8.ops import glu as glu_ops
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import FP8_DTYPES, HP_DTYPES, poison
from tests.ops.test_cast_fused import _assert_dbias_close, _assert_fp8_close
from tests.ops.test_glu_v2 import GLU_KERNELS, glu_kernels

# (rows, F): tails of both tile sizes (128x64 vector, 64x64 scalar), single rows and columns.
SHAPES = [(1, 1), (7, 3), (37, 53), (64, 64), (128, 48), (144, 80), (130, 258), (256, 512)]
ACTIVATIONS = ["swiglu", "geglu"]
VARIANTS = ["forward", "backward", "backward_dbias"]


def _inputs(rows: int, f: int, dtype):
    """h (rows, 2F) and da (rows, F): moderate data, so both activations see both regimes."""
    h = (torch.randn(rows, 2 * f) * 3).to(dtype)
    da = (torch.randn(rows, f) * 2).to(dtype)
    return h, da


def _run(variant, activation, h, da, fp8_dtype, device):
    """The op on `device` and its twin on the CPU: two lists of CPU tensors
    [out, out_t, scale_inv, amax, (dbias)]."""
    rows, f = da.shape
    width = f if variant == "forward" else 2 * f
    scale = torch.empty(1).uniform_(0.05, 20.0)
    amax0 = torch.empty(1).uniform_(0.0, 0.5)
    results = []
    for fn, dev in ((torch.ops.graphfp8, device), (reference, "cpu")):
        out = poison(torch.empty(rows, width, dtype=fp8_dtype, device=dev))
        out_t = poison(torch.empty(width, rows, dtype=fp8_dtype, device=dev))
        scale_inv, amax = torch.full((1,), 7.0, device=dev), amax0.clone().to(dev)
        tail = [scale.to(dev), out, out_t, scale_inv, amax]
        if variant == "forward":
            fn.glu_cast_transpose(h.to(dev), activation, *tail)
            extra = []
        else:
            dbias = None
            if variant == "backward_dbias":
                dbias = poison(torch.empty(width, dtype=h.dtype, device=dev))
            fn.dglu_cast_transpose_dbias(da.to(dev), h.to(dev), activation, *tail, dbias)
            extra = [] if dbias is None else [dbias]
        results.append([t.cpu() for t in (out, out_t, scale_inv, amax, *extra)])
    return results, scale


def _assert_all_equal(got, want, what: str) -> None:
    names = ("out", "out_t", "scale_inv", "amax", "dbias")[: len(got)]
    for name, g, w in zip(names, got, want, strict=True):
        assert_bitwise_equal(g, w, what + name)


def _values(variant, activation, h, da) -> torch.Tensor:
    """What the op casts, from torch ops (float32 transcendentals)."""
    if variant == "forward":
        return glu_ops.glu(h, activation)
    return glu_ops.dglu(da, h, activation)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(device, variant, activation, hp_dtype, fp8_dtype, shape):
    """On CUDA every version of the kernels (switches GLU_V2, GLU_V2_DIV: tests/ops/test_glu_v2.py
    holds them to each other bit for bit)."""
    for version in ["first"] if device == "cpu" else list(GLU_KERNELS):
        with glu_kernels(version):
            _check_matches_reference(device, variant, activation, hp_dtype, fp8_dtype, shape)


def _check_matches_reference(device, variant, activation, hp_dtype, fp8_dtype, shape):
    h, da = _inputs(*shape, hp_dtype)
    (got, want), scale = _run(variant, activation, h, da, fp8_dtype, device)
    assert_bitwise_equal(got[1], got[0].t().contiguous(), "out_t is out.T")
    assert_bitwise_equal(got[2], want[2], "scale_inv")
    if device == "cpu":
        _assert_all_equal(got, want, "")
        return
    values = _values(variant, activation, h, da)
    slack = torch.finfo(values.dtype).eps * values.double().abs() * 4
    if variant != "forward" and activation == "geglu":
        # gelu' sums two terms that can cancel, and gelu(g) = 0.5 g (1 + tanh) loses digits for
        # g << 0: a few-ulp tanhf difference leaves an absolute error of about these sizes
        # (tests/ops/test_cast_fused.py's dGELU slack).
        g, u = h.double().chunk(2, dim=-1)
        d = da.double()
        slack = slack + torch.cat([(d * u).abs() * 2.0**-16, (d * g).abs() * 2.0**-20], dim=-1)
    _assert_fp8_close(got[0], want[0], scale, slack)
    torch.testing.assert_close(got[3], want[3], rtol=0.0, atol=float(slack.max()), msg="amax")
    if variant == "backward_dbias":
        _assert_dbias_close(got[4], values, slack.sum(dim=0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("version", list(GLU_KERNELS))
def test_cuda_swiglu_equals_the_torch_ops_fallback(hp_dtype, version):
    """On CUDA the fused SwiGLU kernels (each version: GLU_KERNELS) and graphfp8.ops.glu's torch
    ops compute the same float32 operations, each rounded on its own, with the same expf: the FP8
    outputs and amax agree bit for bit with the plain cast-transposes of glu() / dglu() (the
    layers' fallback path)."""
    h, da = (t.cuda() for t in _inputs(256, 512, hp_dtype))
    one = torch.ones(1, device="cuda")
    with glu_kernels(version):
        _check_equals_the_fallback(h, da, one)


def _check_equals_the_fallback(h, da, one):
    for fused, composed in (
        (lambda a: ops.glu_cast_transpose(h, "swiglu", one, a, torch.float8_e4m3fn),
         lambda a: ops.cast_transpose(glu_ops.glu(h, "swiglu"), one, a, torch.float8_e4m3fn)),
        (lambda a: ops.dglu_cast_transpose_dbias(da, h, "swiglu", one, a, torch.float8_e5m2,
                                                 dbias=False)[:3],
         lambda a: ops.cast_transpose(glu_ops.dglu(da, h, "swiglu"), one, a, torch.float8_e5m2)),
    ):  # fmt: skip
        amax_f, amax_c = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
        got, want = fused(amax_f), composed(amax_c)
        for name, g, w in zip(("out", "out_t", "scale_inv"), got, want, strict=True):
            assert_bitwise_equal(g, w, name)
        assert_bitwise_equal(amax_f, amax_c, "amax")


def test_special_values_match_reference():
    """exp overflow (g << 0), infinities and NaNs give the twin's bits on the CPU."""
    g = torch.tensor([[-200.0, -88.0, 0.0, 89.0, float("inf"), float("-inf"), float("nan"), 3.0]])
    u = torch.tensor([[1.0, -2.0, 3.0, 0.5, 1.0, 2.0, 1.0, float("nan")]])
    h = torch.cat([g, u], dim=1).repeat(16, 1)
    da = torch.ones(16, 8)
    for activation in ACTIVATIONS:
        for variant in VARIANTS:
            (got, want), _ = _run(variant, activation, h, da, torch.float8_e4m3fn, "cpu")
            _assert_all_equal(got, want, f"{activation} {variant} ")


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_math_is_gate_first_silu_and_tanh_gelu(dtype):
    """glu / dglu are silu(g) * u and gelu_tanh(g) * u of h = [g | u] (TransformerEngine's
    order) and their gradients, to the dtype's rounding."""
    h = (torch.randn(64, 96, dtype=torch.float64) * 3).to(dtype)
    da = torch.randn(64, 48, dtype=torch.float64).to(dtype)
    eps = torch.finfo(dtype).eps
    for activation in ACTIVATIONS:
        want, want_dh = torch.autograd.functional.vjp(
            lambda x, a=activation: _torch_glu(x, a), h.double(), da.double()
        )
        for precise in (False, True):
            got = glu_ops.glu(h, activation, precise=precise).double()
            torch.testing.assert_close(got, want, rtol=2 * eps, atol=1e-6)
            grad = glu_ops.dglu(da, h, activation, precise=precise).double()
            torch.testing.assert_close(grad, want_dh, rtol=8 * eps, atol=1e-5)


def _torch_glu(h: torch.Tensor, activation: str) -> torch.Tensor:
    g, u = h.chunk(2, dim=-1)
    act = F.silu(g) if activation == "swiglu" else F.gelu(g, approximate="tanh")
    return act * u


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_wrappers_allocate_outputs(device, activation):
    h = torch.randn(48, 64, device=device, dtype=torch.bfloat16)
    da = torch.randn(48, 32, device=device, dtype=torch.bfloat16)
    one, zero = torch.ones(1, device=device), torch.zeros(1, device=device)
    a, a_t, si = ops.glu_cast_transpose(h, activation, one, zero, torch.float8_e4m3fn)
    assert a.shape == (48, 32) and a_t.shape == (32, 48) and si.shape == (1,)
    dh, dh_t, _, db = ops.dglu_cast_transpose_dbias(da, h, activation, one, zero,
                                                    torch.float8_e5m2)  # fmt: skip
    assert dh.shape == (48, 64) and dh_t.shape == (64, 48) and dh.dtype == torch.float8_e5m2
    assert db.shape == (64,) and db.dtype == torch.bfloat16
    *_, none = ops.dglu_cast_transpose_dbias(da, h, activation, one, zero, torch.float8_e5m2,
                                             dbias=False)  # fmt: skip
    assert none is None


def test_dbias_of_empty_rows_is_zero():
    h, da = torch.empty(0, 64, dtype=torch.bfloat16), torch.empty(0, 32, dtype=torch.bfloat16)
    *_, db = ops.dglu_cast_transpose_dbias(da, h, "swiglu", torch.ones(1), torch.zeros(1),
                                           torch.float8_e5m2)  # fmt: skip
    assert_bitwise_equal(db, torch.zeros(64, dtype=torch.bfloat16), "dbias")


def _bwd_args(**kw):
    a = dict(
        dy=torch.randn(48, 16, dtype=torch.bfloat16),
        x=torch.randn(48, 32, dtype=torch.bfloat16),
        activation="swiglu",
        scale=torch.ones(1),
        out=torch.empty(48, 32, dtype=torch.float8_e5m2),
        out_t=torch.empty(32, 48, dtype=torch.float8_e5m2),
        scale_inv=torch.empty(1),
        amax=torch.zeros(1),
        dbias=torch.empty(32, dtype=torch.bfloat16),
    )
    a.update(kw)
    return list(a.values())


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(activation="reglu"), r"'activation' must be 'swiglu' or 'geglu'"),
        (dict(x=torch.randn(48, 31, dtype=torch.bfloat16)), r"even width"),
        (dict(dy=torch.randn(48, 32, dtype=torch.bfloat16)), r"'dy' must be \(48, 16\)"),
        (dict(dbias=torch.empty(16, dtype=torch.bfloat16)), r"'dbias' must have shape \(32,\)"),
        (dict(out=torch.empty(48, 16, dtype=torch.float8_e5m2)), r"'out' must have shape"),
    ],
)  # fmt: skip
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.graphfp8.dglu_cast_transpose_dbias(*_bwd_args(**kwargs))


def test_forward_checks_its_output_width():
    h = torch.randn(48, 32, dtype=torch.bfloat16)
    out = torch.empty(48, 32, dtype=torch.float8_e4m3fn)
    out_t = torch.empty(32, 48, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"'out' must have shape \[48, 16\]"):
        torch.ops.graphfp8.glu_cast_transpose(h, "geglu", torch.ones(1), out, out_t,
                                              torch.empty(1), torch.zeros(1))  # fmt: skip
