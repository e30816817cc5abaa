"""graphfp8.numerics: per-cast FP8 statistics of a model (amax, scale, saturation, underflow,
SQNR), for every FP8 tensor role of every layer, computed on the device as the casts run.

    stats = g8.numerics.FP8Stats(model)
    with stats.record(step=s, microbatch=mb):        # every cast inside is measured
        loss_fn(model(x, is_first_microbatch=mb == 0)).backward()
    rows = stats.rows()                              # the one host sync: a list of dicts
    stats.write_csv("fp8_stats.csv")

Per cast (one row): the layer (module path), its GEMM ("fc1"/"fc2" of a LayerNormMLP, "" for a
one-GEMM layer), the role (input, weight, output, grad_output), the slot's scale, the amax the
slot recorded (H[0] after the cast; under current scaling the amax its scale came from), the true
amax of the high-precision tensor that was cast, the fractions of its elements that saturate
(|x * scale| > the format's max) and that underflow to zero (x != 0, FP8 value 0), and the cast's
SQNR in dB. Nothing synchronises until `rows()`; a fused cast (norm, GELU, dGELU) never writes its
high-precision input, so the observer recomputes it from the kernel's saved inputs.
"""

from __future__ import annotations

import contextlib
import csv
import math
from pathlib import Path

import torch
from torch import nn

from graphfp8.fp8 import observe
from graphfp8.fp8.recipe import fp8_max, is_current_scaling
from graphfp8.fp8.scaling import SlotBlock

__all__ = ["FIELDS", "FP8Stats", "cast_stats", "plot_stats"]

# What cast_stats returns, in order.
STATS = ("scale", "recorded_amax", "true_amax", "saturated", "underflow", "nonzero", "numel",
         "signal", "noise")  # fmt: skip
# One row of FP8Stats.rows().
FIELDS = ("step", "microbatch", "layer", "gemm", "role", "scale", "recorded_amax", "true_amax",
          "saturated_frac", "underflow_frac", "sqnr_db", "numel")  # fmt: skip


def cast_stats(hp: torch.Tensor, scale: torch.Tensor, recorded_amax: torch.Tensor,
               fp8_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The statistics of one cast, on hp's device, without a host sync.

    Args:
        hp: (...) the high-precision tensor that was cast (any float dtype).
        scale: (1,) float32, the scale it was cast with (x_fp8 = saturate(x * scale)).
        recorded_amax: (1,) float32, the amax its slot recorded.
        fp8_dtype: the cast's FP8 dtype.

    Returns:
        (len(STATS),) float64: scale, recorded amax, true amax (NaNs ignored), the counts of
        saturated, underflowing, nonzero and all elements, signal sum(x^2) and noise
        sum((x - dequantized)^2).
    """
    x = hp.detach().float()
    s = scale.detach().float().reshape(())
    limit = fp8_max(fp8_dtype)
    y = x * s
    q = y.clamp(-limit, limit).to(fp8_dtype).float()
    err = x - q * torch.reciprocal(s)
    parts = [
        s.double(),
        recorded_amax.detach().double().reshape(()),
        x.abs().nan_to_num(nan=0.0).amax().double()
        if x.numel()
        else x.new_zeros((), dtype=torch.float64),
        (y.abs() > limit).sum().double(),
        ((q == 0) & (x != 0)).sum().double(),
        (x != 0).sum().double(),
        torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
        x.square().sum(dtype=torch.float64),
        err.square().sum(dtype=torch.float64),
    ]
    return torch.stack(parts)


class FP8Stats:
    """Collects cast_stats for every FP8 cast of `model` run inside `record()`.

    Args:
        model: the module holding the graphfp8 layers (names in the rows are its module paths).

    Eager runs only: a captured graph holds the casts its capture ran, not this observer's
    work (CUDA graphs and the CPU tape alike), so `record()` refuses to run during a capture.
    Eager and graphed runs of the same state give the same bits, so recording an eager step of
    a graphed training run measures exactly what the graphs compute.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._names: dict[int, tuple[str, nn.Module]] = {}
        self._where: tuple[int, int | None] | None = None
        self._seen: dict[tuple[int, int, int], int] = {}  # (step, arena, slot) -> casts so far
        self._pending: list[tuple[int, int, str, str, str, torch.Tensor]] = []
        self._rows: list[dict] = []

    @contextlib.contextmanager
    def record(self, step: int, microbatch: int | None = None):
        """Measures every FP8 cast of `model` inside the block (forward and backward). With
        `microbatch` None (a whole step of several microbatches inside one block), a cast's
        microbatch is the number of casts into its slot earlier in the step."""
        from graphfp8.fp8.autocast import STATE

        if STATE.capture is not None:
            raise RuntimeError(
                "graphfp8.numerics: FP8Stats.record() cannot run inside a graph capture; record "
                "an eager step (it computes the same bits)"
            )
        previous = observe.install(self)
        self._where = (step, microbatch)
        try:
            yield self
        finally:
            observe.install(previous)
            self._where = None

    # observe.Observer ----------------------------------------------------------------------------

    def cast(self, block: SlotBlock, i: int, role: str, hp: torch.Tensor) -> None:
        owner = self._owner(block)
        if owner is None or self._where is None:
            return  # a module of another model
        name, module = owner
        arena, s = block.arena, block.start + i
        recorded = block.amax(i)
        if is_current_scaling(arena.recipe):  # H[0] is consumed by the per-cast update
            recorded = arena.scaled_max[s : s + 1] / arena.scale[s : s + 1]
        stats = cast_stats(hp, block.scale(i), recorded, arena.fp8_dtype)
        gemm = _gemm_name(module, i, block is getattr(module.fp8_meta, "bwd", None))
        step, mb = self._where
        if mb is None:
            key = (step, arena.serial, s)
            mb = self._seen.get(key, 0)
            self._seen[key] = mb + 1
        self._pending.append((step, mb, name, gemm, role, stats))

    def _owner(self, block: SlotBlock) -> tuple[str, nn.Module] | None:
        hit = self._names.get(id(block))
        if hit is None:  # modules get their slots on their first FP8 call: look again
            for name, m in self.model.named_modules():
                meta = getattr(m, "fp8_meta", None)
                if meta is not None:
                    self._names[id(meta.fwd)] = self._names[id(meta.bwd)] = (name, m)
            hit = self._names.get(id(block))
        return hit

    # Results ------------------------------------------------------------------------------------

    def rows(self) -> list[dict]:
        """Every recorded cast as a dict of FIELDS (one host sync for all pending casts)."""
        if self._pending:
            values = torch.stack([p[-1].cpu() for p in self._pending]).tolist()
            for (step, mb, name, gemm, role, _), v in zip(self._pending, values, strict=True):
                self._rows.append(
                    _row(step, mb, name, gemm, role, dict(zip(STATS, v, strict=True)))
                )
            self._pending.clear()
        return list(self._rows)

    def write_csv(self, path) -> Path:
        """Writes rows() to `path` as CSV; returns the path."""
        path = Path(path)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(self.rows())
        return path


def _gemm_name(module: nn.Module, i: int, backward: bool) -> str:
    """ "fc1"/"fc2" for the GEMMs of a multi-GEMM layer (from its `gemm_names`), else ""."""
    names = getattr(module, "gemm_names", ())
    if not names:
        return ""
    from graphfp8.fp8.slots import BwdRole, FwdRole, slots_per_gemm

    per = slots_per_gemm(BwdRole if backward else FwdRole)
    return names[i // per]


def _row(step, mb, name, gemm, role, st: dict) -> dict:
    n, signal, noise = st["numel"], st["signal"], st["noise"]
    if noise > 0:
        sqnr = 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf
    else:
        sqnr = math.inf
    return {
        "step": step, "microbatch": mb, "layer": name, "gemm": gemm, "role": role,
        "scale": st["scale"], "recorded_amax": st["recorded_amax"], "true_amax": st["true_amax"],
        "saturated_frac": st["saturated"] / n if n else 0.0,
        "underflow_frac": st["underflow"] / st["nonzero"] if st["nonzero"] else 0.0,
        "sqnr_db": sqnr, "numel": int(n),
    }  # fmt: skip


def plot_stats(rows: list[dict], path) -> Path | None:
    """Saturation and underflow fraction and SQNR per role over steps (mean over layers and
    microbatches), one panel each; returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series: dict[str, dict[int, list[dict]]] = {}
    for r in rows:
        key = f"{r['gemm']}.{r['role']}" if r["gemm"] else r["role"]
        series.setdefault(key, {}).setdefault(r["step"], []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, by_step in sorted(series.items()):
        steps = sorted(by_step)
        for ax, field in zip(axes, ("saturated_frac", "underflow_frac", "sqnr_db"), strict=True):
            vals = [sum(r[field] for r in by_step[s]) / len(by_step[s]) for s in steps]
            ax.plot(steps, vals, label=key)
    for ax, title in zip(axes, ("saturated fraction", "underflow fraction", "SQNR (dB)"),
                         strict=True):  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
