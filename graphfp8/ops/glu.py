"""The gated activations of the GLU MLP (SwiGLU, GeGLU): typed wrappers of their fused FP8 kernels,
the same math in torch ops, and the switch that keeps the CUDA kernels off until they are proven.

fc1 writes h = [g | u] (rows, 2F), gate first (TransformerEngine's order; PyTorch's F.glu gates
the second half), and the activation is a = act(g) * u with act = silu (SwiGLU) or the tanh GELU
(GeGLU). The backward, given da: du = da * act(g), dg = (da * u) * act'(g). Values are computed in
float32 and rounded once to the tensor dtype (csrc/glu_math.h has the exact operation order).

CUDA switch: the fused CUDA kernels (csrc/cuda/glu_cast_transpose.cu) ran on the H200 on
2026-12-01 (their tests against the twins passed; 8.7-15x the torch-ops path) and run unless
GRAPHFP8_CUDA_GLU=0 (read at import; `CUDA_KERNELS` below); with it, the layers run `glu` /
`dglu` in torch ops and the existing cast-transposes, which give the same values but for the
transcendentals' last bits. On the CPU the fused kernels always run.
"""

from __future__ import annotations

import math

import torch

from graphfp8.ops._lib import ops, wraps_op
from graphfp8.ops.switches import env_switch

__all__ = [
    "CUDA_KERNELS",
    "GLU_ACTIVATIONS",
    "dglu",
    "dglu_cast_transpose_dbias",
    "fused_glu_kernels",
    "glu",
    "glu_cast_transpose",
]

GLU_ACTIVATIONS = ("swiglu", "geglu")
CUDA_KERNELS = env_switch("CUDA_GLU")

# gelu_math.h's constants, as the float32 values the kernels use.
_F32 = torch.float32
GELU_BETA = float(torch.tensor(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, dtype=_F32))
GELU_KAPPA = float(torch.tensor(0.044715, dtype=_F32))
GELU_3KAPPA = float(torch.tensor(3.0, dtype=_F32) * torch.tensor(GELU_KAPPA, dtype=_F32))


def fused_glu_kernels(device: torch.device | str) -> bool:
    """Whether the fused GLU kernels run on `device`: always on the CPU, on CUDA with the switch."""
    return torch.device(device).type == "cpu" or CUDA_KERNELS


def _check(h: torch.Tensor, activation: str, what: str) -> int:
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"graphfp8.{what}: activation must be one of {GLU_ACTIVATIONS}, got "
                         f"{activation!r}")  # fmt: skip
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"graphfp8.{what}: argument 'x' must be 2-D (rows, 2 * F), got "
                         f"{tuple(h.shape)}")  # fmt: skip
    return h.shape[1] // 2


@wraps_op("glu_cast_transpose")
def glu_cast_transpose(
    h: torch.Tensor, activation: str, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 cast-transpose of a = act(g) * u for h = [g | u], without writing a itself.

    Args:
        h: (M, 2F) float32/bfloat16/float16, row-major contiguous: fc1's output.
        activation: "swiglu" or "geglu".
        scale: (1,) float32: a_fp8 = saturate(a * scale).
        amax: (1,) float32, updated in place to max(amax, max|a|) (NaNs ignored).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.

    Returns:
        (a_fp8 (M, F), a_t_fp8 (F, M), scale_inv (1,) float32).
    """
    f = _check(h, activation, "glu_cast_transpose")
    out = torch.empty((h.shape[0], f), dtype=fp8_dtype, device=h.device)
    out_t = torch.empty((f, h.shape[0]), dtype=fp8_dtype, device=h.device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=h.device)
    ops.glu_cast_transpose(h, activation, scale, out, out_t, scale_inv, amax)
    return out, out_t, scale_inv


@wraps_op("dglu_cast_transpose_dbias")
def dglu_cast_transpose_dbias(
    da: torch.Tensor,
    h: torch.Tensor,
    activation: str,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype,
    dbias: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The GLU backward fused with the FP8 cast-transpose of dh = [dg | du] and its row sum.

    Args:
        da: (M, F), h's dtype, contiguous: the gradient of a.
        h: (M, 2F) contiguous: the forward's fc1 output.
        activation, fp8_dtype: as in `glu_cast_transpose`.
        scale, amax: as in `glu_cast_transpose`, for dh.
        dbias: also return dh.sum(0).

    Returns:
        (dh_fp8 (M, 2F), dh_t_fp8 (2F, M), scale_inv (1,) float32, dbias (2F,) in h's dtype or
        None).
    """
    f = _check(h, activation, "dglu_cast_transpose_dbias")
    rows = h.shape[0]
    out = torch.empty((rows, 2 * f), dtype=fp8_dtype, device=h.device)
    out_t = torch.empty((2 * f, rows), dtype=fp8_dtype, device=h.device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=h.device)
    db = torch.empty(2 * f, dtype=h.dtype, device=h.device) if dbias else None
    ops.dglu_cast_transpose_dbias(da, h, activation, scale, out, out_t, scale_inv, amax, db)
    return out, out_t, scale_inv, db


# The same math in torch ops (the layers' path where the fused kernels are off, and the twin's) ----


def _exp_neg(g: torch.Tensor, precise: bool) -> torch.Tensor:
    return torch.exp(-g.double()).float() if precise else torch.exp(-g)


def _gelu_parts(g: torch.Tensor, precise: bool):
    """(tanh(inner), x_sq) of gelu_math.h for float32 g."""
    x_sq = g * g
    inner = GELU_BETA * (g + GELU_KAPPA * (x_sq * g))
    return (torch.tanh(inner.double()).float() if precise else torch.tanh(inner)), x_sq


def _gate(g: torch.Tensor, activation: str, precise: bool) -> torch.Tensor:
    """act(g) in float32."""
    if activation == "swiglu":
        return g / (1.0 + _exp_neg(g, precise))
    t, _ = _gelu_parts(g, precise)
    return (0.5 * g) * (1.0 + t)


def _gate_grad(dy: torch.Tensor, g: torch.Tensor, activation: str, precise: bool):
    """dy * act'(g) in float32."""
    if activation == "swiglu":
        s = (1.0 + _exp_neg(g, precise)).reciprocal()
        return dy * (s * (1.0 + g * (1.0 - s)))
    t, x_sq = _gelu_parts(g, precise)
    left_derivative = 0.5 * (1.0 + t)
    right_derivative = ((0.5 * g) * (1.0 - t * t)) * (GELU_BETA * (1.0 + GELU_3KAPPA * x_sq))
    return dy * (left_derivative + right_derivative)


def glu(h: torch.Tensor, activation: str, precise: bool = False) -> torch.Tensor:
    """a = act(g) * u for h = [g | u]: (..., 2F) -> (..., F) in h's dtype, computed in float32.

    precise: compute exp and tanh in float64 (the CPU kernels' transcendentals)."""
    g, u = h.float().chunk(2, dim=-1)
    return (_gate(g, activation, precise) * u).to(h.dtype)


def dglu(da: torch.Tensor, h: torch.Tensor, activation: str, precise: bool = False) -> torch.Tensor:
    """dh = [dg | du] (..., 2F) in da's dtype from da (..., F) and h (..., 2F), as glu()."""
    g, u = h.float().chunk(2, dim=-1)
    d = da.float()
    dg = _gate_grad(d * u, g, activation, precise)
    du = d * _gate(g, activation, precise)
    return torch.cat([dg.to(da.dtype), du.to(da.dtype)], dim=-1)
