"""FP8 attention test data shared by the op and layer tests: quantized Q, K, V, dO with scales
chosen as delayed scaling would (fp8_max / amax of the data), and comparisons that print what
they measure (one GPU run must tell what is wrong)."""

from __future__ import annotations

import torch

from graphfp8 import reference_attention
from graphfp8.fp8.recipe import fp8_max
from graphfp8.testing import sdpa_fp8_backward_scales, sdpa_fp8_scales, sqnr

# (batch, seq, heads, kv_heads, head_dim) per device: small on the CPU; on the GPU the shapes
# cuDNN's FP8 attention is known to take on Hopper (head_dim 128, seq a multiple of 128).
SHAPES = {
    "cpu": [(2, 32, 4, 4, 16), (2, 32, 4, 2, 32)],
    "cuda": [(2, 256, 4, 4, 128), (2, 256, 4, 2, 128), (1, 128, 2, 2, 64)],
}
# Relative tolerance of an amax against the twin's (float64). On the GPU: amax_S and amax_O
# agreed to 5 float32 ulps; cuDNN's amax_dP came out 2.6e-4-5.7e-4 BELOW the twin's in all four
# cases (the worst 0.626243 vs 0.626602), as sums of 128 products (dP = dO V^T) on Hopper's FP8
# tensor cores run when their accumulator keeps fewer bits than float32 and truncates;
# amax_dQ, dK, dV (sums over 256 rows of dS or P codes, some of them another code than the
# twin's) within 4.9e-4 either way. 2e-3 keeps 3.5x the worst.
AMAX_RTOL = {"cpu": 1e-3, "cuda": 2e-3}


def scale_for(amax: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """(1,) float32 scale fp8_max / amax (margin 0), as the scale update computes it."""
    return (torch.tensor([fp8_max(fp8_dtype)], device=amax.device) / amax.float()).reshape(1)


def quantized(shape, fp8_dtype, device, generator, spread: float = 1.0):
    """(x_fp8, scale_inv (1,)) for random data scaled to fill the FP8 range."""
    x = torch.randn(shape, generator=generator).to(device) * spread
    scale = scale_for(x.abs().amax().reshape(1), fp8_dtype)
    return (x * scale).clamp(-fp8_max(fp8_dtype), fp8_max(fp8_dtype)).to(fp8_dtype), 1.0 / scale


def forward_case(shape, fwd_dtype, device, seed: int = 0):
    """Inputs and scales of one forward: (q, k, v, scales dict, attn_scale); scale_S from
    amax_S = 1, scale_O from the twin's amax_O."""
    b, s, h, g, d = shape
    gen = torch.Generator().manual_seed(seed)
    q, dq = quantized((b, s, h, d), fwd_dtype, device, gen)
    k, dk = quantized((b, s, g, d), fwd_dtype, device, gen)
    v, dv = quantized((b, s, g, d), fwd_dtype, device, gen)
    one = torch.ones(1, device=device)
    scales = sdpa_fp8_scales(dq, dk, dv, scale_for(one, fwd_dtype), one)
    attn_scale = d**-0.5
    first = reference_attention.sdpa_fp8_forward(q, k, v, scales, attn_scale)
    scales["scale_o"] = scale_for(first["amax_o"].to(device), fwd_dtype)
    return q, k, v, scales, attn_scale


def backward_scales(q, k, v, o, d_o, stats, fwd_scales, attn_scale, bwd_dtype, descale_do):
    """BWD_SCALES for a backward of these tensors: dP, dQ, dK, dV scales from the twin's amaxes
    (computed with unit scales first)."""
    device = q.device
    scales = sdpa_fp8_backward_scales(fwd_scales, descale_do)
    first = reference_attention.sdpa_fp8_backward(q, k, v, o, d_o, stats, scales, attn_scale)
    for name in ("dp", "dq", "dk", "dv"):
        scales[f"scale_{name}"] = scale_for(first[f"amax_{name}"].to(device), bwd_dtype)
    scales["descale_dp"] = 1.0 / scales["scale_dp"]
    return scales


def report(what: str, want: torch.Tensor, got: torch.Tensor) -> float:
    """Prints and returns the SQNR (dB) of `got` against `want`, with the largest error."""
    want, got = want.double().cpu(), got.double().cpu()
    db = sqnr(want, got)
    err = (got - want).abs().max().item()
    print(
        f"{what}: SQNR {db:.2f} dB, max |err| {err:.4g}, max |want| {want.abs().max():.4g}, "
        f"nonfinite {int((~torch.isfinite(got)).sum())}"
    )
    return db


def check_amax(name: str, want: torch.Tensor, got: torch.Tensor, device) -> None:
    """got within AMAX_RTOL of want ((1,) float32 each, on any device: compared as floats)."""
    w, g = float(want), float(got)
    rel = abs(g - w) / w if w else abs(g)
    rtol = AMAX_RTOL[torch.device(device).type]
    assert rel <= rtol, f"{name}: got {g:.7g}, want {w:.7g}: relative error {rel:.3g} > {rtol}"


def amax_report(what: str, want: torch.Tensor, got: torch.Tensor) -> None:
    """Prints an amax against its reference, with the float32 bits read as an int32 (a kernel
    that writes an amax in another representation shows there)."""
    g = got.detach().float().cpu().reshape(1)
    bits = int(g.view(torch.int32).item())
    print(f"{what}: got {g.item():.6g} (bits as int32 {bits}), want {float(want):.6g}")
