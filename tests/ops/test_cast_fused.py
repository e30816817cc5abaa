"""The fused cast-transposes (dbias, GELU, dGELU + dbias) against their reference twins.

cast_transpose_dbias and gelu_cast_transpose (CPU) are bit-identical to the twins in their FP8
outputs, amax and scale_inv. dgelu_cast_transpose_dbias is not: torch's CPU gelu_backward uses
its vectorised (Sleef) tanh, the kernels use tanhf, and a few-ulp fp32 difference sometimes moves
the value rounded to bf16/fp16 by one ulp, and then an FP8 result by at most one code. The same
holds on the GPU for the GELU forward. Those comparisons allow one FP8 step on at most 1% of the
elements. dbias sums in another order than torch, so it is checked against a float64 sum with a
bound on fp32 accumulation error plus one rounding to the output dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphfp8 import ops, reference
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import FP8_DTYPES, HP_DTYPES, poison

# Tails of both tile sizes (128x64 vector, 64x64 scalar), single rows and columns.
SHAPES = [(1, 1), (1, 33), (7, 1), (37, 53), (64, 64), (128, 48), (144, 80), (130, 258),
          (256, 1024)]  # fmt: skip
FUSED_OPS = ["cast_transpose_dbias", "gelu_cast_transpose", "dgelu_cast_transpose_dbias"]
_ONE_STEP = {torch.float8_e4m3fn: 2.0**-3, torch.float8_e5m2: 2.0**-2}  # relative FP8 spacing


def _inputs(op: str, shape, dtype):
    """(args before scale, scale, prior amax): moderate data so GELU sees both of its regimes."""
    x = (torch.randn(shape) * 3).to(dtype)
    first = (x,)
    if op == "dgelu_cast_transpose_dbias":
        first = (fp8_test_data(shape, dtype).clamp(-1e3, 1e3), x)
    elif op == "cast_transpose_dbias":
        first = (fp8_test_data(shape, dtype).clamp(-1e3, 1e3),)
    scale = torch.empty(1).uniform_(0.05, 20.0)
    return first, scale, torch.empty(1).uniform_(0.0, 0.5)


def _outputs(op, rows, cols, dtype, fp8_dtype, device):
    outs = [
        poison(torch.empty(rows, cols, dtype=fp8_dtype, device=device)),
        poison(torch.empty(cols, rows, dtype=fp8_dtype, device=device)),
        torch.full((1,), 7.0, device=device),
    ]
    if op != "gelu_cast_transpose":
        outs.append(poison(torch.empty(cols, dtype=dtype, device=device)))
    return outs


def _run(op, shape, dtype, fp8_dtype, device):
    """Runs the op on `device` and the twin on the CPU: (got, want) lists of CPU tensors
    [out, out_t, scale_inv, amax, (dbias)]."""
    first, scale, amax0 = _inputs(op, shape, dtype)
    results = []
    for fn, dev in ((getattr(torch.ops.graphfp8, op), device), (getattr(reference, op), "cpu")):
        out, out_t, scale_inv, *dbias = _outputs(op, *shape, dtype, fp8_dtype, dev)
        amax = amax0.clone().to(dev)
        args = [t.to(dev) for t in first] + [scale.to(dev), out, out_t, scale_inv, amax, *dbias]
        fn(*args)
        results.append([t.cpu() for t in (out, out_t, scale_inv, amax, *dbias)])
    return results, first, scale


def _assert_fp8_close(got, want, scale, f_slack):
    """Equal except for at most 1% of the elements, each within one FP8 step of the twin after
    its unquantized value moves by up to f_slack (elementwise, before scaling)."""
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    assert differ.float().mean().item() <= 0.01, f"out: {int(differ.sum())} elements differ"
    g, w = got.double(), want.double()
    allowed = _ONE_STEP[got.dtype] * w.abs() + f_slack * scale.double() + 2.0**-9
    assert bool(((g - w).abs() <= allowed).all()), "out: an element is off by more than a step"


def _assert_dbias_close(dbias, f_values, slack=None):
    """dbias vs a float64 column sum of torch's f values: fp32 accumulation error over `rows`
    terms, plus one rounding to dbias's dtype, plus `slack` (cols,): how far the kernel's own f
    values may be from torch's in sum (dGELU, see the module docstring)."""
    exact = f_values.double().sum(dim=0)
    rows = f_values.shape[0]
    bound = rows * 2.0**-23 * f_values.double().abs().sum(dim=0)
    bound += exact.abs() * torch.finfo(dbias.dtype).eps + torch.finfo(dbias.dtype).tiny
    if slack is not None:
        bound += slack
    err = (dbias.double() - exact).abs()
    assert bool((err <= bound).all()), f"dbias off by up to {float((err - bound).max())}"


def _f_slack(op, first, f_values):
    """How far the kernel's f may be from torch's, elementwise: one ulp of the dtype, and for
    dGELU |dy| * 2^-16 more, since the two terms of gelu' (each below ~1.2) can cancel and leave
    a few-ulp tanh difference at that size."""
    slack = torch.finfo(f_values.dtype).eps * f_values.double().abs()
    if op == "dgelu_cast_transpose_dbias":
        slack += first[0].double().abs() * 2.0**-16
    return slack


def _f_values(op, first):
    """The high-precision values that the op casts (torch's activation, rounded to x's dtype)."""
    if op == "gelu_cast_transpose":
        return F.gelu(first[0], approximate="tanh")
    if op == "dgelu_cast_transpose_dbias":
        return torch.ops.aten.gelu_backward(first[0], first[1], approximate="tanh")
    return first[0]


@pytest.mark.parametrize("op", FUSED_OPS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_matches_reference(device, op, hp_dtype, fp8_dtype, shape):
    (got, want), first, scale = _run(op, shape, hp_dtype, fp8_dtype, device)
    assert_bitwise_equal(got[1], got[0].t().contiguous(), "out_t is out.T")
    assert_bitwise_equal(got[2], want[2], "scale_inv")
    exact = op == "cast_transpose_dbias" or (op == "gelu_cast_transpose" and device == "cpu")
    f_values = _f_values(op, first)
    f_slack = _f_slack(op, first, f_values)
    if exact:
        for name, g, w in zip(
            ("out", "out_t", "amax"), got[:2] + got[3:4], want[:2] + want[3:4], strict=True
        ):
            assert_bitwise_equal(g, w, name)
    else:
        _assert_fp8_close(got[0], want[0], scale, f_slack)
        # max|f| moves by at most the largest elementwise slack of f.
        slack = float(f_slack.max()) if f_slack.numel() else 0.0
        torch.testing.assert_close(got[3], want[3], rtol=0.0, atol=slack, msg="amax")
    if op != "gelu_cast_transpose":
        _assert_dbias_close(got[4], f_values, None if exact else f_slack.sum(dim=0))


def test_fused_ops_write_amax_of_the_activation():
    x = torch.tensor([[-3.0, 0.5], [2.0, 4.0]], dtype=torch.bfloat16)
    amax = torch.zeros(1)
    ops.gelu_cast_transpose(x, torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == F.gelu(x, approximate="tanh").float().abs().max().item()


def test_dbias_of_empty_rows_is_zero():
    dy = torch.empty(0, 32, dtype=torch.bfloat16)
    *_, dbias = ops.cast_transpose_dbias(dy, torch.ones(1), torch.zeros(1), torch.float8_e5m2)
    assert_bitwise_equal(dbias, torch.zeros(32, dtype=torch.bfloat16), "dbias")


@pytest.mark.parametrize("op", FUSED_OPS)
def test_wrappers_allocate_outputs(device, op):
    dy = torch.randn(48, 32, device=device, dtype=torch.bfloat16)
    x = torch.randn(48, 32, device=device, dtype=torch.bfloat16)
    args = (dy, x) if op == "dgelu_cast_transpose_dbias" else (dy,)
    res = getattr(ops, op)(*args, torch.ones(1, device=device), torch.zeros(1, device=device),
                           torch.float8_e5m2)  # fmt: skip
    assert res[0].shape == (48, 32) and res[1].shape == (32, 48)
    assert res[0].dtype == res[1].dtype == torch.float8_e5m2
    if op != "gelu_cast_transpose":
        assert res[3].shape == (32,) and res[3].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "op, kwargs, pattern",
    [
        ("cast_transpose_dbias", {"dbias": torch.empty(31)}, r"'dbias' must have the dtype"),
        ("cast_transpose_dbias", {"dbias": torch.empty(31, dtype=torch.bfloat16)},
         r"'dbias' must have shape \(32,\)"),
        ("dgelu_cast_transpose_dbias", {"x": torch.empty(48, 32)}, r"'act_in' must have the"),
        ("gelu_cast_transpose", {"x": torch.empty(2, 48, 32, dtype=torch.bfloat16)},
         r"'x' must be 2-D"),
    ],
)  # fmt: skip
def test_bad_arguments(op, kwargs, pattern):
    a = dict(
        dy=torch.randn(48, 32, dtype=torch.bfloat16),
        x=torch.randn(48, 32, dtype=torch.bfloat16),
        scale=torch.ones(1),
        out=torch.empty(48, 32, dtype=torch.float8_e5m2),
        out_t=torch.empty(32, 48, dtype=torch.float8_e5m2),
        scale_inv=torch.empty(1),
        amax=torch.zeros(1),
        dbias=torch.empty(32, dtype=torch.bfloat16),
    )
    a.update(kwargs)
    names = {
        "cast_transpose_dbias": ["dy", "scale", "out", "out_t", "scale_inv", "amax", "dbias"],
        "gelu_cast_transpose": ["x", "scale", "out", "out_t", "scale_inv", "amax"],
        "dgelu_cast_transpose_dbias": ["dy", "x", "scale", "out", "out_t", "scale_inv", "amax",
                                       "dbias"],
    }[op]  # fmt: skip
    with pytest.raises(RuntimeError, match=pattern):
        getattr(torch.ops.graphfp8, op)(*[a[n] for n in names])
