"""Blockwise FP8 (DeepSeek-V3's recipe, TransformerEngine's Float8BlockScaling): the quantizers
of 1x128 tiles and 128x128 blocks, their dequantization, and the blockwise-scaled GEMM.

The quantizers run the fused kernel of graphfp8/ops/blockwise_fused.py (one pass per operand,
both layouts from one read) or, as GRAPHFP8_BLOCKWISE_KERNELS says, the torch ops here
(torch_quantize: a few elementwise and reduction launches per quantization), which are the
kernel's twin (docs/fp8.md, "Blockwise scaling").

    tiles  x (R, C)  -> x_fp8 (R, C), scale_inv (R, ceil(C / 128))          one scale per 1x128
    blocks w (R, C)  -> w_fp8 (R, C), scale_inv (ceil(R / 128), ceil(C / 128)) one per 128x128

Scale of a tile or block with amax a = max |x| over it (no history):
    s = fp8_max / a                  when a is finite and > 0 (float32 division), else 1
    s = FLT_MAX                      when that overflows (a tiny a)
    s = 2 ** floor(log2(s))          with power_2_scale (the default), by clearing the mantissa
    x_fp8 = saturate(x * s), scale_inv = 1 / s
A partial last tile or block (C or R not a multiple of 128) takes its amax over the elements it
has. The GEMM contracts the last dim of both operands: out (M, N) = a (M, K) @ b (N, K).T, with
a in tiles along K and b in tiles or blocks along K.
"""

from __future__ import annotations

import os

import torch

from graphfp8.ops.blockwise_fused import blockwise_quantize, fused_on

__all__ = [
    "TILE",
    "GEMM_MODE",
    "blockwise_gemm",
    "dequantize_blocks",
    "dequantize_tiles",
    "quantize",
    "quantize_blocks",
    "quantize_tiles",
    "torch_quantize",
    "scaled_mm_operands",
    "scales_from_amax",
]

TILE = 128
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_EXPONENT_BITS = 0x7F800000  # a positive normal float32 with its mantissa cleared

# How CUDA runs the blockwise GEMM (GRAPHFP8_BLOCKWISE_GEMM, read at import):
#   unset      raise, naming the torch version (the scaled_mm path is not verified on a GPU yet:
#              scripts/probe_blockwise_mm.py records what torch's _scaled_mm accepts)
#   emulate    dequantize per block and multiply in float32, as the CPU does
#   scaled_mm  torch.nn.functional.scaled_mm with BlockWise1x128 / BlockWise128x128 scales
GEMM_MODE = os.environ.get("GRAPHFP8_BLOCKWISE_GEMM", "")


def scales_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, power_2_scale: bool):
    """(scale, scale_inv) float32 of the module docstring's rule, for any shape of amaxes."""
    amax = amax.float()
    usable = torch.isfinite(amax) & (amax > 0)
    # A true division: `float / tensor` is reciprocal() * float in torch, rounded twice.
    quotient = torch.full_like(amax, _FP8_MAX[fp8_dtype]).div(torch.where(usable, amax, 1.0))
    scale = torch.where(usable, quotient, 1.0)
    scale = scale.clamp(max=torch.finfo(torch.float32).max)  # inf -> FLT_MAX
    if power_2_scale:
        scale = (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    return scale, scale.reciprocal()


def _tiled(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (R, C) as tiles (ceil(R / rows), rows, ceil(C / 128), 128): a view when R and C fill
    whole tiles, else a zero-padded copy (zeros leave every amax as it is)."""
    r, c = x.shape
    pr, pc = -r % rows, -c % TILE
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.reshape((r + pr) // rows, rows, (c + pc) // TILE, TILE)


def _untiled(t: torch.Tensor, shape) -> torch.Tensor:
    """The (R, C) elements of tiles t, row-major (elementwise ops keep their input's strides, so
    tiles of a transposed view would come back column-major: cuBLASLt refuses such an A)."""
    r, c = shape
    full = t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
    return (full if full.shape == (r, c) else full[:r, :c]).contiguous()


def torch_quantize(x, rows: int, fp8_dtype, power_2_scale: bool):
    """x (R, C) in tiles of `rows` x 128 by torch ops: (x_fp8 (R, C), scale_inv) as `quantize`
    without transpose (x may be any 2-D view; the fused kernel's twin)."""
    _check(x, fp8_dtype)
    tiles = _tiled(x, rows)
    amax = tiles.abs().amax(dim=(1, 3))  # exact in x's dtype: a maximum of its values
    scale, scale_inv = scales_from_amax(amax, fp8_dtype, power_2_scale)
    limit = _FP8_MAX[fp8_dtype]
    # Each tile times its scale, broadcast (float32 products: x is promoted, never copied).
    q = (tiles * scale[:, None, :, None]).clamp(-limit, limit).to(fp8_dtype)
    return _untiled(q, x.shape), scale_inv


def _dequantize_tiles(t_fp8: torch.Tensor, scale_inv: torch.Tensor, rows: int) -> torch.Tensor:
    tiles = _tiled(t_fp8.float(), rows)
    return _untiled(tiles * scale_inv[:, None, :, None], t_fp8.shape)


def _torch_transpose(x, rows: int, q, scale_inv, fp8_dtype, power_2_scale: bool) -> tuple:
    """The layout of x.T: its own 1x128 tiles, or the blocks' bytes and scales transposed."""
    if rows == 1:
        return torch_quantize(x.t(), 1, fp8_dtype, power_2_scale)
    return q.t().contiguous(), scale_inv.t().contiguous()


def _write(buf: torch.Tensor, value: torch.Tensor, noop) -> None:
    """buf = value, or (noop given) kept where noop holds 1: the kernel's flag, in torch ops."""
    if noop is None:
        buf.copy_(value)
        return
    raw = (lambda t: t.view(torch.uint8)) if buf.dtype.itemsize == 1 else (lambda t: t)
    raw(buf).copy_(torch.where(noop == 1, raw(buf), raw(value)))


def quantize(x: torch.Tensor, rows: int, fp8_dtype=torch.float8_e4m3fn,
             power_2_scale: bool = True, *, transpose: bool = False, out=None,
             noop: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """x (R, C) float32/bf16/fp16 in tiles of `rows` x 128 (1: 1x128 tiles, 128: 128x128
    blocks), by the fused kernel or the torch ops (module docstring); the arguments and results
    of graphfp8.ops.blockwise_fused.blockwise_quantize: (x_fp8, scale_inv[, x_t_fp8,
    scale_inv_t]), written into `out` when given, nothing written where noop holds 1."""
    _check(x, fp8_dtype)
    if fused_on(x.device):
        return blockwise_quantize(x.contiguous(), rows, fp8_dtype, power_2_scale,
                                  transpose=transpose, out=out, noop=noop)  # fmt: skip
    result = torch_quantize(x, rows, fp8_dtype, power_2_scale)
    if transpose:
        result += _torch_transpose(x, rows, *result, fp8_dtype, power_2_scale)
    if out is None:
        return result
    for buf, value in zip(out, result, strict=True):
        _write(buf, value, noop)
    return out


def quantize_tiles(x: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, power_2_scale: bool = True):
    """x: (R, C) float32/bf16/fp16. Returns (x_fp8 (R, C), scale_inv (R, ceil(C / 128))
    float32): one scale per 1x128 tile along C (the GEMM's K)."""
    return quantize(x, 1, fp8_dtype, power_2_scale)


def quantize_blocks(w: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, power_2_scale: bool = True):
    """w: (R, C). Returns (w_fp8 (R, C), scale_inv (ceil(R / 128), ceil(C / 128)) float32): one
    scale per 128x128 block, so that w_fp8.t() with scale_inv.t() is w.t()'s quantization."""
    return quantize(w, TILE, fp8_dtype, power_2_scale)


def dequantize_tiles(x_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """(R, C) float32 = x_fp8 * its tile's scale_inv (R, ceil(C / 128))."""
    return _dequantize_tiles(x_fp8, scale_inv, 1)


def dequantize_blocks(w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """(R, C) float32 = w_fp8 * its block's scale_inv (ceil(R / 128), ceil(C / 128))."""
    return _dequantize_tiles(w_fp8, scale_inv, TILE)


def _dequantize(t_fp8, scale_inv) -> torch.Tensor:
    """Tiles or blocks, told apart by the scales' row count."""
    if scale_inv.shape[0] == t_fp8.shape[0]:
        return dequantize_tiles(t_fp8, scale_inv)
    return dequantize_blocks(t_fp8, scale_inv)


def blockwise_gemm(a_fp8, a_scale_inv, b_fp8, b_scale_inv, out_dtype: torch.dtype):
    """out (M, N) = dequantized a (M, K) @ dequantized b (N, K).T, accumulated in float32.

    Args:
        a_fp8: (M, K) FP8 in 1x128 tiles along K; a_scale_inv: (M, ceil(K / 128)) float32.
        b_fp8: (N, K) FP8 in tiles (b_scale_inv (N, ceil(K / 128))) or 128x128 blocks
            (b_scale_inv (ceil(N / 128), ceil(K / 128))).
        out_dtype: bfloat16, float16 or float32.

    Returns:
        (M, N) of out_dtype. CPU: the exact emulation (dequantize per block, one float32
        matmul). CUDA: as GRAPHFP8_BLOCKWISE_GEMM says (GEMM_MODE).
    """
    (m, k), (n, k2) = a_fp8.shape, b_fp8.shape
    kt = -(-k // TILE)
    if (
        k != k2
        or a_scale_inv.shape != (m, kt)
        or b_scale_inv.shape not in ((n, kt), (-(-n // TILE), kt))
    ):
        raise ValueError(
            f"blockwise_gemm: a ({m}, {k}) with scales {tuple(a_scale_inv.shape)} and b "
            f"({n}, {k2}) do not form a tiles x (tiles or blocks) GEMM"
        )
    if a_fp8.device.type == "cuda":
        if GEMM_MODE == "scaled_mm":
            return _scaled_mm(a_fp8, a_scale_inv, b_fp8, b_scale_inv, out_dtype)
        if GEMM_MODE != "emulate":
            raise NotImplementedError(
                f"blockwise FP8 GEMM on CUDA: torch {torch.__version__}'s blockwise _scaled_mm "
                "path is not verified by graphfp8 yet (run scripts/probe_blockwise_mm.py on the "
                "GPU); set GRAPHFP8_BLOCKWISE_GEMM=emulate (dequantized float32 GEMM, slow) or "
                "GRAPHFP8_BLOCKWISE_GEMM=scaled_mm (torch's cuBLAS blockwise GEMM, sm_90, CUDA >= "
                "12.9)"
            )
    a_hp = dequantize_tiles(a_fp8, a_scale_inv)
    b_hp = _dequantize(b_fp8, b_scale_inv)
    with torch._C._DisableAutocast():
        return (a_hp @ b_hp.t()).to(out_dtype)


def scaled_mm_operands(a_fp8, a_scale_inv, b_fp8, b_scale_inv):
    """The arguments torch.nn.functional.scaled_mm takes for out = a @ b.T, in the layouts
    cuBLASLt and torch 2.11 accept (scripts/probe_blockwise_mm.py, docs/fp8.md):

        mat_a    (M, K) row-major                  scale_a (M, K/128) outer-dim-major (M stride 1)
        mat_b    (K, N) column-major (b.T)         1x128:   scale_b (N, K/128) outer-dim-major
                                                   128x128: scale_b (K/128, N/128), stride (1, L4)
    where L4 is K/128 rounded up to a multiple of 4. Returns (mat_a, mat_b, scale_a, recipe_a,
    scale_b, recipe_b); copies only operands not already in their layout."""
    from torch.nn.functional import ScalingType

    n = b_fp8.shape[0]
    scale_a = a_scale_inv.t().contiguous().t()
    if b_scale_inv.shape[0] == n:
        scale_b, recipe_b = b_scale_inv.t().contiguous().t(), ScalingType.BlockWise1x128
    else:
        pad, b_inv = -b_scale_inv.shape[1] % 4, b_scale_inv.contiguous()
        # F.pad copies even with nothing to pad (a DtoD memcpy per GEMM): pad only when needed.
        scale_b = (torch.nn.functional.pad(b_inv, (0, pad)) if pad else b_inv).t()
        recipe_b = ScalingType.BlockWise128x128
    return (a_fp8.contiguous(), b_fp8.contiguous().t(), scale_a, ScalingType.BlockWise1x128,
            scale_b, recipe_b)  # fmt: skip


def _scaled_mm(a_fp8, a_scale_inv, b_fp8, b_scale_inv, out_dtype):
    """torch's cuBLAS blockwise GEMM (sm_90, CUDA >= 12.9; K a multiple of 128)."""
    from torch.nn.functional import scaled_mm

    operands = scaled_mm_operands(a_fp8, a_scale_inv, b_fp8, b_scale_inv)
    return scaled_mm(*operands, output_dtype=out_dtype)


def _check(x: torch.Tensor, fp8_dtype) -> None:
    if x.dim() != 2:
        raise ValueError(f"blockwise quantization takes a 2-D tensor, got {tuple(x.shape)}")
    if fp8_dtype not in _FP8_MAX:
        raise TypeError(f"blockwise quantization: not an FP8 dtype: {fp8_dtype}")
