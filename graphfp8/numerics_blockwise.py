"""graphfp8.numerics_blockwise: per-block FP8 statistics of a model under Float8BlockScaling
(which has no slots for graphfp8.numerics.FP8Stats to read), computed on the device as each GEMM
operand is quantized, in eager runs and inside captured graphs alike.

    stats = g8.numerics_blockwise.BlockStats(model)  # before make_graphed_*: its ops join them
    stats.enable(step % 10 == 0); ...; stats.collect(step, mb); stats.write_csv(path)

The same calls and rows as FP8Stats (graphfp8.numerics: its FIELDS, so role_digest and
plot_stats take them), one row per layer, GEMM and role ("input": x in 1x128 tiles, "weight":
the 128x128 blocks, "grad_output": dy in 1x128 tiles, the dgrad GEMM's), plus per-block columns
(graphfp8/ops/blockwise_stats.py): blocks, saturated_block_frac and underflow_block_frac (blocks
with any saturated / underflowing element), worst_block_rel_err (the largest
||x_b - dequantized_b|| / ||x_b|| over blocks) and the distribution of the block scales (log2:
min, max, mean). `scale` is 2**log2_scale_mean (a geometric mean); recorded_amax = true_amax, the
largest |x|. A blockwise FP8 primary weight's row is its stored blocks against their own
dequantized values (no rounding error by construction; its scales are what it reports).

Cost: while disabled, an eager quantization runs nothing more (no kernel: the report is skipped
on the host); while enabled, one kernel per operand (graphfp8.ops.blockwise_stats: each block's
partial sums in float64, into a buffer per operand), reduced by collect (about 15 small ops per
operand, eagerly). A graph captured while it is installed holds that kernel whatever the setting
at capture, gated by a device flag as FP8Stats' kernels are: a replay with the report disabled
runs one empty kernel per operand and writes nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from graphfp8.fp8 import context, observe
from graphfp8.numerics import FIELDS, write_rows_csv
from graphfp8.ops.blockwise_stats import PARTIALS, STATS, blockwise_stats, reduce_partials

__all__ = ["BLOCK_FIELDS", "BlockStats"]

BLOCK_FIELDS = (*FIELDS, "blocks", "saturated_block_frac", "underflow_block_frac",
                "worst_block_rel_err", "log2_scale_min", "log2_scale_max",
                "log2_scale_mean")  # fmt: skip
_AT = {name: i for i, name in enumerate(STATS)}


class BlockStats:
    """Per-block statistics of every blockwise GEMM operand of `model` (module docstring).

    Args:
        model: the module holding the layers; rows name them by their path in it and the GEMM
            by its weight's name ("fc1_weight" -> "fc1", "weight" -> "").

    A per-tensor cast reported while this is installed goes to the observer installed before
    it (an FP8Stats of a model mixing recipes), else nowhere.
    """

    def __init__(self, model: nn.Module) -> None:
        self._where = {}
        for name, p in model.named_parameters():
            layer, _, attr = name.rpartition(".")
            self._where[id(p)] = (layer, "" if attr == "weight" else attr.removesuffix("_weight"))
        self._flags = {p.device: None for p in model.parameters()}
        self._enabled = False
        for device in self._flags:  # before any capture: created inside one, a fill is a node
            self._flags[device] = torch.zeros(1, device=device)
        self._keys: list[tuple] = []  # (layer, gemm, role) in first-seen order
        self._out: dict[tuple, torch.Tensor] = {}  # key -> (len(STATS),) float64
        self._sizes: dict[tuple, tuple[int, int]] = {}  # key -> (numel, blocks)
        self._collected: list[tuple[int, int, list[tuple], torch.Tensor]] = []
        self._rows: list[dict] = []
        self._previous = observe.install(self)

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self, on: bool = True) -> None:
        """Keeps (True) or drops the statistics of the quantizations from now on."""
        if on != self._enabled:
            self._enabled = on
            for flag in self._flags.values():
                flag.fill_(1.0 if on else 0.0)
            if on:  # a buffer a capture allocated holds garbage until its kernel runs enabled
                for partials in self._out.values():
                    partials.zero_()

    def cast(self, block, i: int, role: str, source) -> None:
        """A per-tensor cast: the previous observer's (module docstring)."""
        if self._previous is not None:
            self._previous.cast(block, i, role, source)

    def block_cast(self, weight: torch.Tensor, role: str, source) -> None:
        """observe.observe_block's call: the statistics of one quantization into its buffer;
        `source()` gives block_stats' arguments. Eagerly while disabled: nothing at all."""
        capturing = context.current().capturing or (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        )
        if not capturing and not self._enabled:
            return
        x, x_fp8, scale_inv, rows = source()
        layer, gemm = self._where.get(id(weight), ("?", ""))
        key = (layer, gemm, role)
        flag = self._flags.get(x.device)
        if flag is None:
            raise RuntimeError(
                f"BlockStats: {layer} runs on {x.device}, none of the model's parameters "
                "does; create BlockStats(model) on its device"
            )
        out = self._out.get(key)
        if out is None or out.shape[0] != scale_inv.numel():
            if out is None:
                self._keys.append(key)
            # Eagerly the kernel fills it now. A capture while disabled leaves it unfilled (a fill
            # would be a node of every replay; enable() zeroes it); while enabled, zeros (a CUDA
            # capture runs nothing: a collect before the first replay must read zeros).
            shape = (scale_inv.numel(), len(PARTIALS))
            alloc = torch.zeros if capturing and self._enabled else torch.empty
            out = self._out[key] = alloc(shape, dtype=torch.float64, device=x.device)
        self._sizes[key] = (x.numel(), scale_inv.numel())
        # One kernel; a graph replays it whatever the setting then: empty while the flag is 0.
        blockwise_stats(x.contiguous(), x_fp8, scale_inv, rows, flag, out)

    def collect(self, step: int, microbatch: int = 0) -> None:
        """Stores the latest statistics of every operand (no sync) while enabled."""
        if not self._enabled or not self._keys:
            return
        keys = list(self._keys)
        stats = torch.stack([reduce_partials(self._out[k]) for k in keys])
        self._collected.append((step, microbatch, keys, stats))
        for k in keys:
            self._out[k].zero_()

    def close(self) -> None:
        """Removes the observer (graphs captured with it keep its ops, kept only while enabled:
        disable it first)."""
        if observe.observer() is self:
            observe.install(self._previous)

    def __enter__(self) -> BlockStats:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rows(self) -> list[dict]:
        """Every collected operand as a dict of BLOCK_FIELDS (one host sync)."""
        for step, mb, keys, values in self._collected:
            for key, v in zip(keys, values.cpu().tolist(), strict=True):
                if v[_AT["nonzero"]] or v[_AT["log2_scale_max"]]:  # else not quantized then
                    self._rows.append(_row(step, mb, key, self._sizes[key], v))
        self._collected.clear()
        return list(self._rows)

    def write_csv(self, path) -> Path:
        """Writes rows() to `path` as CSV; returns the path."""
        return write_rows_csv(path, BLOCK_FIELDS, self.rows())


def _row(step: int, mb: int, key: tuple, sizes: tuple[int, int], v: list[float]) -> dict:
    s = dict(zip(STATS, v, strict=True))
    numel, blocks = sizes
    signal, noise = s["signal"], s["noise"]
    sqnr = math.inf if noise <= 0 else (10 * math.log10(signal / noise) if signal else -math.inf)
    layer, gemm, role = key
    return {
        "step": step, "microbatch": mb, "layer": layer, "gemm": gemm, "role": role,
        "scale": 2.0 ** s["log2_scale_mean"], "recorded_amax": s["amax"], "true_amax": s["amax"],
        "saturated_frac": s["saturated"] / numel, "underflow_frac":
            s["underflow"] / s["nonzero"] if s["nonzero"] else 0.0,
        "sqnr_db": sqnr, "numel": numel, "blocks": blocks,
        "saturated_block_frac": s["saturated_blocks"] / blocks,
        "underflow_block_frac": s["underflow_blocks"] / blocks,
        "worst_block_rel_err": s["worst_block_rel_err"], "log2_scale_min": s["log2_scale_min"],
        "log2_scale_max": s["log2_scale_max"], "log2_scale_mean": s["log2_scale_mean"],
    }  # fmt: skip
