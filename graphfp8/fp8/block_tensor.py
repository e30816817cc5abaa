"""Float8BlockTensor: an FP8 primary weight stored in 128x128 blocks, one float32 scale_inv per
block (Float8BlockScaling's weight layout: docs/fp8.md, "Blockwise scaling").

A Float8Tensor whose `_scale_inv` is (ceil(N / 128), ceil(K / 128)) instead of (1,): value ~=
data * its block's scale_inv. As for Float8Tensor it never computes a scale: whoever quantizes
into it (graphfp8.fp8.primary.BlockWeightQuantizer) writes data and block scales together. It
keeps no transpose cache: a 128x128 block is its transpose's block, so the dgrad GEMM transposes
data and scales at the GEMM (modules/_blockwise.py). Only Float8BlockScaling's GEMMs read it;
any other torch op sees the dequantized values, except a move to another device (.to(device),
.cpu(), .cuda()), which moves the blocks.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.ops.blockwise import TILE, dequantize_blocks

__all__ = ["Float8BlockTensor", "is_block_fp8"]

_ALIAS_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
# torch FSDP2's fully_shard chunks every parameter into row shards (fp8/tensor_fsdp.py)
_SPLIT_OPS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)


def block_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(ceil(N / 128), ceil(K / 128)): the block scales of an (N, K) weight."""
    return -(-shape[0] // TILE), -(-shape[1] // TILE)


class Float8BlockTensor(Float8Tensor):
    """FP8 data in 128x128 blocks plus their scales.

    Attributes:
        _data: (N, K) float8_e4m3fn, row-major.
        _scale_inv: (ceil(N / 128), ceil(K / 128)) float32, contiguous.
        _power_2_scale: whether the scales are powers of 2 (the recipe's power_2_scale at
            quantization); a forward under the other setting raises.
    """

    _power_2_scale: bool

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, nominal_dtype: torch.dtype,
                power_2_scale: bool = True, *,
                requires_grad: bool = False) -> Float8BlockTensor:  # fmt: skip
        if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
            raise TypeError(
                f"Float8BlockTensor: data must be 2-D float8_e4m3fn, got {tuple(data.shape)} "
                f"{data.dtype}"
            )
        if scale_inv.dtype != torch.float32 or scale_inv.shape != block_scale_shape(data.shape):
            raise TypeError(
                f"Float8BlockTensor: scale_inv must be float32 {block_scale_shape(data.shape)} "
                f"for data {tuple(data.shape)}, got {tuple(scale_inv.shape)} {scale_inv.dtype}"
            )
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=nominal_dtype, device=data.device, requires_grad=requires_grad
        )
        self._data, self._scale_inv = data, scale_inv
        self._transpose, self._transpose_valid = None, False
        self._power_2_scale = power_2_scale
        return self

    @classmethod
    def empty(cls, shape, nominal_dtype: torch.dtype, device, power_2_scale: bool = True):
        """A persistent (N, K) weight buffer and its block scales (ones). No kernel."""
        data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        scale_inv = torch.ones(block_scale_shape(shape), dtype=torch.float32, device=device)
        return cls(data, scale_inv, nominal_dtype, power_2_scale)

    def transpose_fp8(self, noop=None):
        raise RuntimeError(
            "Float8BlockTensor keeps no transpose: a blockwise FP8 weight runs only under "
            "Float8BlockScaling, whose dgrad transposes its blocks at the GEMM"
        )

    rebuild_transpose_ = transpose_fp8

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """data * its block's scale_inv, as a plain tensor of `dtype` (the nominal one default)."""
        return dequantize_blocks(self._data, self._scale_inv).to(dtype or self.dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"Float8BlockTensor(fp8_dtype={self.fp8_dtype}, nominal_dtype={self.dtype}, "
            f"shape={tuple(self.shape)}, blocks={tuple(self._scale_inv.shape)}, "
            f"power_2_scale={self._power_2_scale}, data={self.dequantize()})"
        )

    def __deepcopy__(self, memo) -> Float8BlockTensor:
        new = Float8BlockTensor(self._data.clone(), self._scale_inv.clone(), self.dtype,
                                self._power_2_scale, requires_grad=self.requires_grad)  # fmt: skip
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        return new

    def fsdp_pre_all_gather(self, *args, **kwargs):
        raise NotImplementedError(
            "torch FSDP2 of blockwise FP8 primary weights is not supported: shard them with "
            "graphfp8.MasterWeights(model, shard_group=...) (docs/sharding.md)"
        )

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], {"nominal_dtype": self.dtype, "p2": self._power_2_scale}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8BlockTensor(inner["_data"], inner["_scale_inv"], meta["nominal_dtype"],
                                 meta["p2"])  # fmt: skip

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIAS_OPS:
            src = args[0]
            return Float8BlockTensor(src._data, src._scale_inv, src.dtype, src._power_2_scale)
        if func is torch.ops.aten.copy_.default:
            return _copy_(args[0], args[1])
        if func is torch.ops.aten._to_copy.default and _moves_only(args[0], kwargs):
            return _moved(args[0], kwargs["device"])
        if func in _SPLIT_OPS:  # shards would be high-precision copies, trained as such
            raise NotImplementedError(
                "Float8BlockTensor: splitting a blockwise FP8 weight (torch FSDP2's fully_shard "
                "does) is not supported; shard its masters with graphfp8.MasterWeights(model, "
                "shard_group=...) (docs/sharding.md), or split weight.dequantize()"
            )
        if func._schema.is_mutable:
            raise NotImplementedError(
                f"Float8BlockTensor does not support the in-place op {func}; dequantize() first "
                "(FP8 primary weights are trained through graphfp8.MasterWeights)"
            )
        # Anything else runs on the dequantized values.
        unwrap = lambda t: t.dequantize() if isinstance(t, Float8Tensor) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _moves_only(src: Float8BlockTensor, kwargs: dict) -> bool:
    """Whether a _to_copy (.to, .cuda, .cpu) only changes the device: the blocks then move as
    they are (a state dict moved to the CPU and loaded back copies them bit for bit); a dtype
    change asks for the high-precision values."""
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    return (
        device is not None
        and dtype in (None, src.dtype)
        and kwargs.get("layout")
        in (
            None,
            torch.strided,
        )
    )


def _moved(src: Float8BlockTensor, device) -> Float8BlockTensor:
    return Float8BlockTensor(src._data.to(device, copy=True), src._scale_inv.to(device, copy=True),
                             src.dtype, src._power_2_scale)  # fmt: skip


def _copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """copy_ with a Float8BlockTensor on either side: blocks into blocks bit for bit (data and
    scales); into a plain tensor, the dequantized values; anything else into blocks raises (a
    graphfp8 module's load_state_dict quantizes a high-precision entry first)."""
    if not isinstance(dst, Float8Tensor):
        hp = dst.dtype if dst.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
        return dst.copy_(src.dequantize(hp))
    if not isinstance(dst, Float8BlockTensor) or not isinstance(src, Float8BlockTensor):
        raise TypeError(
            "Float8BlockTensor.copy_: a blockwise FP8 weight copies only from and into another "
            "one (a per-tensor FP8 weight has one scale); load a high-precision entry through a "
            "graphfp8 module's load_state_dict, which quantizes it"
        )
    if src.shape != dst.shape:
        raise ValueError(
            f"Float8BlockTensor.copy_: source {tuple(src.shape)} does not match destination "
            f"{tuple(dst.shape)}"
        )
    dst._data.copy_(src._data)
    dst._scale_inv.copy_(src._scale_inv)
    dst._power_2_scale = src._power_2_scale
    return dst


def is_block_fp8(t) -> bool:
    """A blockwise FP8 primary weight."""
    return isinstance(t, Float8BlockTensor)


torch.serialization.add_safe_globals([Float8BlockTensor])
