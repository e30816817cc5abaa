"""Every kernel that records an amax, at production shapes on the GPU (on the CPU, whose kernels
are serial loops that do not depend on the size, at an eighth of them): the amax it folds equals
max |x| of the exact high-precision tensor it casts (a max is exact: compared with ==),
scale_inv is 1 / scale bit for bit, an element beyond the format's range saturates to its max,
and the next scale follows the recipe's formula bit for bit (issue 27's exactness checks).

The exact tensor: the input itself for the plain casts; rope_qkv's output for rope_fp8 (its twin
is bit-exact); the kernel's own float32 output (hp_out, float32 input) for the norms. The GELU
and dGELU kernels never write theirs and their tanh differs from torch's by ulps, so their amax
is checked == where the maximum sits at an input whose result is exact (gelu(x) = x and
gelu'(x) = 1 for x >= 16), and within one ulp of torch's result elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphfp8 import ops, reference
from graphfp8.fp8.recipe import fp8_max
from tests.helpers import CUDA_PARAM, FP8_DTYPES

# The production shapes on the GPU; on the CPU (CI) an eighth of the smallest one and an
# odd one (rows and columns not multiples of 16).
CPU_SHAPES = [(1024, 1024), (1032, 1048)]
GPU_SHAPES = [(8192, 1024), (8192, 3072), (8192, 4096), (16384, 8192), (8200, 1040)]
CASES = [pytest.param("cpu", s, id=f"cpu-{s[0]}x{s[1]}") for s in CPU_SHAPES] + [
    pytest.param(*CUDA_PARAM.values, s, marks=CUDA_PARAM.marks, id=f"cuda-{s[0]}x{s[1]}")
    for s in GPU_SHAPES
]
PLAIN = ["cast_to_fp8", "cast_transpose", "cast_transpose_dbias"]


def _scale(fp8_dtype, device) -> torch.Tensor:
    """A scale that puts the data's bulk well inside the range and the planted peak beyond it."""
    return torch.tensor([fp8_max(fp8_dtype) / 6.0], device=device)


def _data(shape, dtype, device, peak: float = 8.0) -> torch.Tensor:
    """Normal data with one planted peak of `peak` (beyond 6, the range at _scale)."""
    x = torch.randn(shape, device=device).clamp(-5.0, 5.0)
    x[shape[0] // 3, shape[1] // 2] = -peak
    return x.to(dtype)


def _check_scale_inv_and_update(scale, scale_inv, amax, fp8_dtype) -> None:
    want_inv = torch.tensor(1.0) / scale.cpu()
    assert torch.equal(scale_inv.cpu().view(torch.int32), want_inv.view(torch.int32))
    history = amax.detach().clone().reshape(1, 1)
    new_scale = scale.detach().clone()
    ops.scale_update_(history, new_scale, torch.full_like(scale, fp8_max(fp8_dtype)), True)
    want = torch.tensor(fp8_max(fp8_dtype), dtype=torch.float32) / amax.cpu()
    assert torch.equal(new_scale.cpu(), want), "scale = fp8_max / amax, bit for bit"


def _check_saturated(out: torch.Tensor, where: tuple[int, int], fp8_dtype) -> None:
    got = out[where].float().item()
    assert got == -fp8_max(fp8_dtype), f"the planted peak must saturate to -max, got {got}"


@pytest.mark.parametrize("device, shape", CASES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("op", PLAIN)
def test_plain_cast_amax_exact(op, fp8_dtype, device, shape):
    x = _data(shape, torch.bfloat16, device)
    scale, amax = _scale(fp8_dtype, device), torch.zeros(1, device=device)
    out = getattr(ops, op)(x, scale, amax, fp8_dtype)
    assert torch.equal(amax, x.float().abs().amax().reshape(1))
    _check_saturated(out[0], (shape[0] // 3, shape[1] // 2), fp8_dtype)
    _check_scale_inv_and_update(scale, out[-2] if op == "cast_transpose_dbias" else out[-1],
                                amax, fp8_dtype)  # fmt: skip


@pytest.mark.parametrize("device, shape", CASES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_norm_amax_exact(norm, residual, fp8_dtype, device, shape):
    x = torch.randn(shape, device=device)
    res = torch.randn(shape, device=device) if residual else None
    gamma = torch.rand(shape[1], device=device) * 2 + 0.5  # moved away from 1: gamma counts
    beta = torch.randn(shape[1], device=device) * 0.3
    scale, amax = _scale(fp8_dtype, device), torch.zeros(1, device=device)
    kw = dict(transpose=True, hp_out=True, residual=res)
    if norm == "layernorm":
        o = ops.layernorm_fp8(x, gamma, beta, 1e-5, scale, amax, fp8_dtype, **kw)
    else:
        o = ops.rmsnorm_fp8(x, gamma, 1e-5, scale, amax, fp8_dtype, **kw)
    assert torch.equal(amax, o.out_hp.abs().amax().reshape(1)), "amax of the kernel's own y"
    peak = o.out_hp.abs().argmax()
    if o.out_hp.reshape(-1)[peak].abs() * scale > fp8_max(fp8_dtype):
        assert o.out.reshape(-1)[peak].float().abs().item() == fp8_max(fp8_dtype)
    _check_scale_inv_and_update(scale, o.scale_inv, amax, fp8_dtype)


@pytest.mark.parametrize("device, shape", CASES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_gelu_amax_exact(fp8_dtype, device, shape):
    h = _data(shape, torch.bfloat16, device, peak=0.0)
    h[shape[0] // 3, shape[1] // 2] = 16.0  # gelu(16) = 16 exactly: the maximum of gelu(h)
    scale, amax = _scale(fp8_dtype, device), torch.zeros(1, device=device)
    out, _, scale_inv = ops.gelu_cast_transpose(h, scale, amax, fp8_dtype)
    assert amax.item() == 16.0
    _check_saturated(-out.float(), (shape[0] // 3, shape[1] // 2), fp8_dtype)
    _check_scale_inv_and_update(scale, scale_inv, amax, fp8_dtype)
    h[shape[0] // 3, shape[1] // 2] = 0.0  # elsewhere: within one bf16 ulp of torch's GELU
    amax.zero_()
    ops.gelu_cast_transpose(h, scale, amax, fp8_dtype)
    want = F.gelu(h.float(), approximate="tanh").to(torch.bfloat16).float().abs().amax()
    torch.testing.assert_close(amax.reshape(()), want, rtol=2.0**-7, atol=0.0)


@pytest.mark.parametrize("device, shape", CASES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dgelu_amax_exact(fp8_dtype, device, shape):
    h = _data(shape, torch.bfloat16, device, peak=0.0)
    dy = _data(shape, torch.bfloat16, device, peak=0.0)
    where = (shape[0] // 3, shape[1] // 2)
    h[where], dy[where] = 16.0, -8.0  # gelu'(16) = 1: dh = dy exactly there, the maximum
    scale, amax = _scale(fp8_dtype, device), torch.zeros(1, device=device)
    out, _, scale_inv, _ = ops.dgelu_cast_transpose_dbias(dy, h, scale, amax, fp8_dtype)
    assert amax.item() == 8.0
    _check_saturated(out, where, fp8_dtype)
    _check_scale_inv_and_update(scale, scale_inv, amax, fp8_dtype)


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_rope_fp8_amax_exact(fp8_dtype, device):
    """(batch 8, seq 1024, 3 x 16 heads x 64): the 100m preset's QKV (on the CPU batch 1)."""
    from graphfp8.modules.transformer import rope_tables

    b, s, heads, d = 8 if device != "cpu" else 1, 1024, 16, 64
    qkv = torch.randn(b, s, 3 * heads * d, device=device).to(torch.bfloat16)
    cos, sin = rope_tables(s, d, 10000.0, torch.float32, device)
    quantizers = [(_scale(fp8_dtype, device), torch.zeros(1, device=device), fp8_dtype)
                  for _ in range(3)]  # fmt: skip
    _, scale_inv = ops.rope_fp8(qkv, cos, sin, heads, quantizers)
    rotated = torch.empty_like(qkv, device="cpu")
    reference.rope_qkv(qkv.cpu(), cos.cpu(), sin.cpu(), heads, False, rotated)
    parts = rotated.view(b, s, 3, heads, d)
    for p, (scale, amax, _) in enumerate(quantizers):
        assert torch.equal(amax.cpu(), parts[:, :, p].float().abs().amax().reshape(1)), p
        _check_scale_inv_and_update(scale, scale_inv[p], amax, fp8_dtype)
