"""Float8Tensor under torch FSDP2 (fully_shard): the views that sharding takes of an FP8 primary
weight stay FP8, and the all-gather moves FP8 bytes (docs/sharding.md, "FSDP2").

fully_shard cuts each parameter into row chunks on dim 0: `torch.chunk` (aten.split), a padded
`new_zeros`, `narrow` (aten.slice), `copy_` and `view(-1)` of the parameter; any op Float8Tensor
does not know runs on the dequantized values, so before these ops were handled here every FP8
weight became a plain high-precision shard. Each of them is a view of (or, new_zeros, a new)
FP8 data with the same per-tensor scale_inv, which is what they return when the view is
contiguous (a column slice still gives the dequantized values, as before).

The all-gather (FSDP2's extension hooks): fsdp_pre_all_gather hands over the shard's FP8 bytes as
uint8 (padded to FSDP's shard size) and its scale_inv; fsdp_post_all_gather wraps the gathered
uint8 buffer - no copy - as the whole FP8 weight with that scale_inv (every shard holds the same
one: graphfp8.distributed.fsdp_masters writes them back with one amax per weight over the group)
and a transpose buffer that FSDP frees and reallocates with the gathered data: every all-gather
marks it stale, and the forward and the backward rebuild it before use (modules/_functional.py).
"""

from __future__ import annotations

import math

import torch

__all__ = ["SHARD_OPS", "fsdp_module_types", "post_all_gather", "pre_all_gather"]

aten = torch.ops.aten


def fsdp_module_types() -> tuple[type, ...]:
    """torch's FSDP module classes (FSDP2's FSDPModule, FSDP1's FullyShardedDataParallel): the
    one test of "is this module under FSDP?" (is_fsdp_fp8 in tensor.py asks it of a weight);
    () without torch.distributed."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FSDPModule, FullyShardedDataParallel)


def _wrap(data: torch.Tensor, like) -> object:
    """`data` as a Float8Tensor (like's class: this module extends it) with like's scale_inv
    (and its mark of a gathered weight: FSDP2 takes a view of what post_all_gather returns)."""
    out = type(like)(data, like._scale_inv, like.dtype)
    if getattr(like, "_fsdp_gathered", False):
        out._fsdp_gathered = True
    return out


def _rows_view(func, args, kwargs):
    """split / split_with_sizes / slice / view / as_strided of the FP8 data, same scale_inv;
    NotImplemented (the dequantized values, as for any other op) when a view is not contiguous:
    graphfp8's kernels read FP8 data row-major."""
    src, *rest = args
    out = func(src._data, *rest, **kwargs)
    views = out if isinstance(out, (list, tuple)) else [out]
    if not all(t.is_contiguous() for t in views):
        return NotImplemented
    if isinstance(out, (list, tuple)):
        return [_wrap(t, src) for t in out]
    result = _wrap(out, src)
    t = src._transpose  # as_strided to the unpadded shape after the all-gather keeps it
    if t is not None and out.dim() == 2 and tuple(t.shape) == (out.shape[1], out.shape[0]):
        result._transpose = t
    return result


def _new_zeros(func, args, kwargs):
    """A new zero FP8 tensor of the given shape with a copy of the scale_inv (FSDP's padded
    shard)."""
    src, size = args[0], args[1]
    data = torch.zeros(size, dtype=torch.uint8, device=src.device).view(src.fp8_dtype)
    return type(src)(data, src._scale_inv.clone(), src.dtype)


SHARD_OPS = {
    aten.split.Tensor: _rows_view,
    aten.split_with_sizes.default: _rows_view,
    aten.slice.Tensor: _rows_view,
    aten.view.default: _rows_view,
    aten.as_strided.default: _rows_view,
    aten.new_zeros.default: _new_zeros,
}


def pre_all_gather(shard, outer_size: torch.Size, world: int):
    """(all-gather inputs, metadata) of one FP8 shard: its bytes as uint8 with FSDP's padded
    shard size (ceil(rows / world) rows: a short last shard is padded, in place when its storage
    holds the padding, as FSDP's own shards do), and (scale_inv, fp8 dtype, the whole shape)."""
    rows = -(-outer_size[0] // world)
    padded = (rows, *outer_size[1:])
    data = shard._data.view(torch.uint8)
    if tuple(data.shape) != padded:
        numel = math.prod(padded)
        if data.untyped_storage().nbytes() >= data.storage_offset() + numel:
            data = data.as_strided(padded, torch.empty(padded, device="meta").stride(),
                                   data.storage_offset())  # fmt: skip
        else:
            full = torch.zeros(padded, dtype=torch.uint8, device=data.device)
            full[: data.shape[0]].copy_(data)
            data = full
    return (data,), (shard._scale_inv, shard.fp8_dtype, tuple(outer_size))


def post_all_gather(cls, outputs, metadata, param_dtype, out=None):
    """The gathered FP8 weight (a `cls`, Float8Tensor): `outputs[0]` ((world * rows, ...)
    uint8) as its data, no copy. With `out` (every all-gather after the first: FSDP reuses its
    buffers) only the scale_inv and the transpose's staleness change. Returns (the weight, its
    buffers) or None."""
    (gathered,) = outputs
    scale_inv, fp8_dtype, shape = metadata
    if out is not None:
        out._scale_inv = scale_inv
        out.mark_data_changed(transpose_written=False)
        return None
    buffers = [gathered]
    transpose = None
    if len(shape) == 2:  # the weight's (cols, rows) transpose, freed with the gathered data
        transpose = torch.empty(shape[1], shape[0], dtype=torch.uint8, device=gathered.device)
        buffers.append(transpose)
        transpose = transpose.view(fp8_dtype)
    weight = cls(gathered.view(fp8_dtype), scale_inv, param_dtype, transpose=transpose)
    weight._fsdp_gathered = True  # gathered again before every use (modules/_context.py)
    return weight, tuple(buffers)
