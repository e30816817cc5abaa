"""The FP8 GEMM: torch._scaled_mm (cuBLASLt) with the CUDA rules enforced on every device.

The three GEMMs of a linear layer y = x @ w.T, with A row-major and B column-major:

    forward  y  (M, N) = x  (M, K) @ w.T  : a = x_fp8,     b = w_fp8.t()
    dgrad    dx (M, K) = dy (M, N) @ w    : a = dy_fp8,    b = w_t_fp8.t()
    wgrad    dw (N, K) = dy.T (N, M) @ x  : a = dy_t_fp8,  b = x_t_fp8.t()

The CPU `_scaled_mm` accepts E5M2 x E5M2, dims that are not multiples of 16 and operands or
scales at any address, which CUDA rejects (cuBLASLt's FP8 GEMMs need every matrix and scale
pointer 16-byte aligned); checking here makes a CPU test fail wherever the GPU would.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["fp8_gemm", "check_aligned", "check_gemm_dims", "onednn_off"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_gemm_dims(k: int, n: int, what: str = "graphfp8.fp8_gemm") -> None:
    """Raises ValueError unless the inner dim k and the output dim n are multiples of 16, as
    cuBLASLt FP8 GEMMs require (the row count m is free)."""
    if k % 16 or n % 16:
        raise ValueError(
            f"{what}: FP8 GEMMs need the inner dim k and the output dim n to be multiples of 16, "
            f"got k={k}, n={n}"
        )


def check_aligned(t: torch.Tensor, arg: str, what: str = "graphfp8.fp8_gemm") -> None:
    """Raises ValueError unless t's first element is 16-byte aligned, as cuBLASLt needs of an FP8
    GEMM's matrices and scales (the GPU answers CUBLAS_STATUS_NOT_SUPPORTED at the call)."""
    offset = t.data_ptr() % 16
    if offset:
        raise ValueError(
            f"{what}: '{arg}' must start at a 16-byte aligned address (cuBLASLt FP8 GEMMs need "
            f"it), got one {offset} bytes past: a view into a larger buffer? pass its own tensor"
        )


def fp8_gemm(
    a_fp8: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """out = (a_fp8 * a_scale_inv) @ (b_fp8 * b_scale_inv) (+ bias), accumulated in fp32.

    Args:
        a_fp8: (m, k) FP8, row-major contiguous.
        a_scale_inv: (1,) float32, 16-byte aligned (its own tensor, not a view at an offset).
        b_fp8: (k, n) FP8, column-major (b_fp8.t() is contiguous).
        b_scale_inv: (1,) float32, 16-byte aligned.
        out_dtype: bfloat16, float16 or float32.
        bias: optional (n,) of out_dtype; only with bf16/fp16 output (a cuBLASLt rule).
        use_fast_accum: cuBLASLt fast accumulation (forward GEMMs only, as TE does).

    Returns:
        (m, n) tensor of out_dtype.
    """
    name = "graphfp8.fp8_gemm"
    if a_fp8.dtype not in _FP8 or b_fp8.dtype not in _FP8:
        raise TypeError(f"{name}: both operands must be FP8, got {a_fp8.dtype} and {b_fp8.dtype}")
    if a_fp8.dtype == torch.float8_e5m2 and b_fp8.dtype == torch.float8_e5m2:
        raise TypeError(f"{name}: E5M2 x E5M2 is not supported by cuBLASLt")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{name}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if a_fp8.dim() != 2 or b_fp8.dim() != 2:
        raise ValueError(f"{name}: operands must be 2-D, got {a_fp8.dim()}-D and {b_fp8.dim()}-D")
    if a_fp8.device != b_fp8.device:
        raise ValueError(f"{name}: operands on {a_fp8.device} and {b_fp8.device}")
    (m, k), (k2, n) = a_fp8.shape, b_fp8.shape
    if k != k2:
        raise ValueError(f"{name}: shapes ({m}, {k}) and ({k2}, {n}) cannot be multiplied")
    if not a_fp8.is_contiguous():
        raise ValueError(f"{name}: 'a_fp8' must be row-major contiguous")
    if not b_fp8.t().is_contiguous():
        raise ValueError(f"{name}: 'b_fp8' must be column-major (b_fp8.t() contiguous)")
    check_gemm_dims(k, n, name)
    for arg, t in (("a_fp8", a_fp8), ("b_fp8", b_fp8), ("a_scale_inv", a_scale_inv),
                   ("b_scale_inv", b_scale_inv)):  # fmt: skip
        check_aligned(t, arg, name)
    if bias is not None:
        if out_dtype == torch.float32:
            raise ValueError(f"{name}: a fused bias needs a bf16/fp16 output, not float32")
        if bias.dtype != out_dtype or bias.shape != (n,):
            raise ValueError(
                f"{name}: 'bias' must be ({n},) {out_dtype}, got {tuple(bias.shape)} {bias.dtype}"
            )
    kw = dict(scale_a=a_scale_inv, scale_b=b_scale_inv, bias=bias, out_dtype=out_dtype,
              use_fast_accum=use_fast_accum)  # fmt: skip
    if a_fp8.device.type != "cpu":
        return torch._scaled_mm(a_fp8, b_fp8, **kw)
    with onednn_off():
        return torch._scaled_mm(a_fp8, b_fp8, **kw)


@contextlib.contextmanager
def onednn_off():
    """torch routes a CPU `_scaled_mm` to oneDNN on CPUs with AMX-INT8, where FP8 runs a path
    ~200x slower than torch's own fp32 emulation (~40 ms for a 64x64x256 GEMM) that also rounds
    differently. graphfp8's CPU FP8 GEMMs always run the emulation; the replay tape replays each
    `_scaled_mm` under the switch it was captured with (graphs/tape.py). The emulation's fp32
    matmul is an ordinary op that torch.autocast("cpu") would run in bf16 (a backward inside an
    autocast region reaches it so): autocast is off inside too."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        with torch._C._DisableAutocast():
            yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)
