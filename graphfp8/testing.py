"""Test helpers shared by the test suite, the benchmarks and users: bitwise comparison, SQNR, FP8
test data, the scale dicts of the FP8 attention ops."""

from __future__ import annotations

import math

import torch

__all__ = [
    "assert_bitwise_equal",
    "sqnr",
    "fp8_test_data",
    "sdpa_fp8_backward_scales",
    "sdpa_fp8_scales",
    "TOLERANCES",
]

# docs/benchmarking.md: FP8 GEMM vs an fp32 matmul of the dequantized operands.
TOLERANCES = {torch.float32: 3e-3, torch.bfloat16: 7e-2, torch.float16: 7e-2}

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(_INT_VIEW[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Asserts same shape, dtype and bit pattern (NaN payloads included)."""
    prefix = f"{what}: " if what else ""
    assert actual.shape == expected.shape, f"{prefix}shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{prefix}dtype {actual.dtype} != {expected.dtype}"
    a, e = _bits(actual), _bits(expected)
    if not torch.equal(a, e):
        raise AssertionError(prefix + _describe_difference(actual, expected, a, e))


def _describe_difference(actual, expected, a, e) -> str:
    """How many elements differ, how many of them are NaN on both sides (NaN encodings differ),
    and the first difference of each kind with its bits."""
    act, exp = actual.detach().cpu(), expected.detach().cpu()
    bad = a != e
    nan_pair = torch.zeros_like(bad)
    if act.is_floating_point():
        nan_pair = bad & torch.isnan(act.float()) & torch.isnan(exp.float())
    width = 2 * a.element_size()

    def show(mask) -> str:
        at = tuple(mask.nonzero()[0].tolist())
        bits = f"0x{int(a[at]) & (1 << 4 * width) - 1:0{width}x}"
        want = f"0x{int(e[at]) & (1 << 4 * width) - 1:0{width}x}"
        return f"at {at}: {act[at]!r} ({bits}) != {exp[at]!r} ({want})"

    n_bad, n_nan = int(bad.sum()), int(nan_pair.sum())
    text = f"{n_bad} of {a.numel()} elements differ ({n_nan} are NaN on both sides)"
    if n_nan:
        text += f"; first NaN pair {show(nan_pair)}"
    if n_bad > n_nan:
        text += f"; first other {show(bad & ~nan_pair)}"
    return text


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of `actual` against `reference`."""
    ref = reference.detach().double()
    err = (actual.detach().double() - ref).pow(2).mean()
    sig = ref.pow(2).mean()
    if err == 0:
        return math.inf
    return float(10 * torch.log10(sig / err))


def fp8_test_data(shape, dtype, *, generator=None, device="cpu", specials=False) -> torch.Tensor:
    """Random data spanning ~7 decades (subnormal, normal and saturating FP8 values after
    scaling), optionally salted with +-inf, NaN, -NaN and signed zeros."""
    g = generator
    base = torch.randn(shape, generator=g, dtype=torch.float32)
    decades = torch.empty(shape).uniform_(-4.0, 3.0, generator=g)
    x = base * torch.pow(10.0, decades)
    if specials and x.numel() >= 6:
        flat = x.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:6]
        flat[idx] = torch.tensor([math.inf, -math.inf, math.nan, -math.nan, 0.0, -0.0])
    return x.to(dtype).to(device)


def sdpa_fp8_scales(descale_q, descale_k, descale_v, scale_s, scale_o) -> dict:
    """The `scales` of ops.sdpa_fp8_forward ((1,) float32 device tensors each): the inputs'
    scale_inv, S's scale (and its inverse), O's scale."""
    return dict(descale_q=descale_q, descale_k=descale_k, descale_v=descale_v, scale_s=scale_s,
                descale_s=1.0 / scale_s, scale_o=scale_o)  # fmt: skip


def sdpa_fp8_backward_scales(fwd: dict, descale_do) -> dict:
    """The `scales` of ops.sdpa_fp8_backward for a forward run with `fwd`: its input scales, O's
    inverse scale, dO's scale_inv, and unit scales for dP, dQ, dK, dV (set them from their
    amaxes once known)."""
    one = torch.ones_like(fwd["scale_o"])
    return dict(descale_q=fwd["descale_q"], descale_k=fwd["descale_k"],
                descale_v=fwd["descale_v"], descale_o=1.0 / fwd["scale_o"], descale_do=descale_do,
                descale_s=fwd["descale_s"], scale_s=fwd["scale_s"], scale_dp=one, descale_dp=one,
                scale_dq=one, scale_dk=one, scale_dv=one)  # fmt: skip
