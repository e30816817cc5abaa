"""Float8Tensor: FP8 data, its own private scale_inv and a lazy transpose cache.

A Float8Tensor never computes a scale: whoever casts into it (a kernel) writes its data and its
scale_inv together, so the two always pair up, however the recipe's scales move on. It is a
wrapper subclass whose nominal shape and dtype are the high-precision ones, so it can flow
through autograd between graphfp8 modules (LayerNormLinear(fp8_output=True) -> Linear); any
other torch op sees the dequantized values, but for the views and the padded copy that torch
FSDP2 takes of a parameter, which stay FP8, and FSDP2's all-gather hooks (fp8/tensor_fsdp.py).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from graphfp8 import ops
from graphfp8.fp8 import tensor_fsdp

__all__ = ["Float8Tensor", "is_fsdp_fp8"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_ALIAS_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


class Float8Tensor(torch.Tensor):
    """FP8 data plus its private scale: value ~= data * scale_inv.

    Attributes:
        _data: (rows, cols) or (...), float8_e4m3fn / float8_e5m2, row-major.
        _scale_inv: (1,) float32, written by the kernel that wrote `_data`.
        _transpose: (cols, rows) FP8 buffer or None; valid when `_transpose_valid`.
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _transpose: torch.Tensor | None
    _transpose_valid: bool

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        nominal_dtype: torch.dtype,
        *,
        transpose: torch.Tensor | None = None,
        transpose_valid: bool = False,
        requires_grad: bool = False,
    ) -> Float8Tensor:
        if data.dtype not in _FP8_DTYPES:
            raise TypeError(f"Float8Tensor: data must be FP8, got {data.dtype}")
        if scale_inv.dtype != torch.float32 or scale_inv.numel() != 1:
            raise TypeError("Float8Tensor: scale_inv must be a one-element float32 tensor")
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=nominal_dtype, device=data.device, requires_grad=requires_grad
        )
        self._data = data
        self._scale_inv = scale_inv
        self._transpose = transpose
        self._transpose_valid = transpose_valid and transpose is not None
        return self

    @classmethod
    def empty(
        cls, shape: tuple[int, int], fp8_dtype: torch.dtype, nominal_dtype: torch.dtype, device
    ) -> Float8Tensor:
        """A persistent 2-D buffer with room for its transpose (weight workspaces). No kernel."""
        rows, cols = shape
        return cls(
            torch.empty(rows, cols, dtype=fp8_dtype, device=device),
            torch.ones(1, dtype=torch.float32, device=device),
            nominal_dtype,
            transpose=torch.empty(cols, rows, dtype=fp8_dtype, device=device),
        )

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    def transpose_fp8(self, noop: torch.Tensor | None = None) -> torch.Tensor:
        """The (cols, rows) FP8 transpose of the data seen as (rows, cols) = (numel / last dim,
        last dim), computed once into a persistent buffer and cached."""
        if not self._transpose_valid:
            data2d = self._data.reshape(-1, self._data.shape[-1])
            rows, cols = data2d.shape
            if self._transpose is None:
                self._transpose = torch.empty(cols, rows, dtype=self.fp8_dtype, device=self.device)
            ops.fp8_transpose(data2d, out_t=self._transpose, noop=noop)
            self._transpose_valid = True
        return self._transpose

    def rebuild_transpose_(self, noop: torch.Tensor | None = None) -> torch.Tensor:
        """Writes the (cols, rows) transpose cache of the 2-D data now, valid or not: a graph
        capture must record the kernel even when warmup left the cache valid; `noop` ((1,)
        float32 device flag, 1 = skip) then decides on every replay."""
        ops.fp8_transpose(self._data, out_t=self._transpose, noop=noop)
        self._transpose_valid = True
        return self._transpose

    def mark_data_changed(self, transpose_written: bool) -> None:
        """Called by whoever rewrote `_data`: the cached transpose is valid only if it was
        rewritten by the same kernel."""
        self._transpose_valid = transpose_written and self._transpose is not None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """data * scale_inv as a plain tensor of `dtype` (the nominal dtype by default)."""
        return ops.dequantize(self._data.contiguous(), self._scale_inv, dtype or self.dtype)

    def tolist(self):
        """The dequantized values as nested lists, as every other read of a Float8Tensor (torch
        refuses .tolist() of tensor subclasses). The FP8 codes: `t._data.view(torch.uint8)`."""
        return self.dequantize().tolist()

    def numpy(self, *, force: bool = False):
        """The dequantized values as a numpy array (a bfloat16 nominal dtype has none: use
        `t.dequantize(torch.float32).numpy()`)."""
        if self.dtype == torch.bfloat16:
            raise TypeError(
                "Float8Tensor.numpy(): numpy has no bfloat16 (the nominal dtype); use "
                "t.dequantize(torch.float32).numpy()"
            )
        return self.dequantize().numpy(force=force)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"Float8Tensor(fp8_dtype={self.fp8_dtype}, nominal_dtype={self.dtype}, "
            f"shape={tuple(self.shape)}, scale_inv={self._scale_inv.item():.6g}, "
            f"data={self.dequantize()})"
        )

    def __deepcopy__(self, memo) -> Float8Tensor:
        transpose = None if self._transpose is None else self._transpose.clone()
        new = Float8Tensor(
            self._data.clone(), self._scale_inv.clone(), self.dtype,
            transpose=transpose, transpose_valid=self._transpose_valid,
            requires_grad=self.requires_grad,
        )  # fmt: skip
        if getattr(self, "_is_param", False):  # an FP8 primary weight (graphfp8.fp8.primary)
            new._is_param = True
        memo[id(self)] = new
        return new

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2's hook: this shard's FP8 bytes (uint8) and scale_inv (fp8/tensor_fsdp.py)."""
        return tensor_fsdp.pre_all_gather(self, outer_size, mesh.size())

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2's hook: the gathered bytes as the whole FP8 weight, no copy."""
        return tensor_fsdp.post_all_gather(type(self), all_gather_outputs, metadata, param_dtype,
                                           out)  # fmt: skip

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], {"nominal_dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta["nominal_dtype"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIAS_OPS:
            src = args[0]
            out = Float8Tensor(
                src._data,
                src._scale_inv,
                src.dtype,
                transpose=src._transpose,
                transpose_valid=src._transpose_valid,
            )
            if getattr(src, "_fsdp_gathered", False):  # FSDP2's nn.Parameter of it: the same
                out._fsdp_gathered = True
            return out
        if func is torch.ops.aten.copy_.default:
            return _copy_(args[0], args[1])
        if func in tensor_fsdp.SHARD_OPS:  # views FSDP2 takes of a parameter stay FP8
            out = tensor_fsdp.SHARD_OPS[func](func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func._schema.is_mutable:
            raise NotImplementedError(
                f"Float8Tensor does not support the in-place op {func}; dequantize() first (FP8 "
                "primary weights are trained through graphfp8.MasterWeights)"
            )
        # Anything else runs on the dequantized values, in the nominal dtype.
        unwrap = lambda t: t.dequantize() if isinstance(t, Float8Tensor) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """copy_ with a Float8Tensor on either side (load_state_dict): FP8 into FP8 copies data and
    scale_inv bit for bit (the transpose cache becomes stale); FP8 into a plain tensor copies the
    dequantized values. A plain tensor into FP8 would need a scale, which a Float8Tensor never
    computes: graphfp8 modules quantize such checkpoint entries before copying."""
    if not isinstance(dst, Float8Tensor):
        hp = dst.dtype if dst.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
        return dst.copy_(src.dequantize(hp))
    if not isinstance(src, Float8Tensor):
        raise TypeError(
            "Float8Tensor.copy_: the source is a plain tensor; quantize it first "
            "(graphfp8.fp8.primary.quantize_weight), or load it through a graphfp8 module's "
            "load_state_dict, which does"
        )
    if src.shape != dst.shape or src.fp8_dtype != dst.fp8_dtype:
        raise ValueError(
            f"Float8Tensor.copy_: source {tuple(src.shape)} {src.fp8_dtype} does not match "
            f"destination {tuple(dst.shape)} {dst.fp8_dtype}"
        )
    dst._data.copy_(src._data)
    dst._scale_inv.copy_(src._scale_inv)
    dst.mark_data_changed(transpose_written=False)
    return dst


# Checkpoints holding FP8 primary weights load with torch.load's default weights_only=True.
torch.serialization.add_safe_globals([Float8Tensor])


def is_fsdp_fp8(p: torch.Tensor) -> bool:
    """An FSDP2 shard of an FP8 weight (a DTensor of a Float8Tensor): the one test of "is this
    weight sharded by FSDP2?" (tensor_fsdp.py keeps its views FP8)."""
    return isinstance(getattr(p, "_local_tensor", None), Float8Tensor)
