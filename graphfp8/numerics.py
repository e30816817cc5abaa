"""graphfp8.numerics: per-cast FP8 statistics of a model (amax, scale, saturation, underflow,
SQNR) for every FP8 tensor role of every layer, computed on the device as the casts run, in
eager runs and inside captured graphs alike.

    stats = g8.numerics.FP8Stats(model)      # before make_graphed_*: its kernels join the graphs
    for step in range(steps):
        stats.enable(step % 10 == 0)         # one fill_ of a device flag when it changes
        for mb in range(num_microbatches):
            loss_fn(graphed(x[mb], is_first_microbatch=mb == 0)).backward()
            stats.collect(step, mb)          # no-op unless enabled: one stack of the results
        ...
    stats.write_csv("fp8_stats.csv")         # the one host sync

One row per cast: the layer (module path), its GEMM ("fc1"/"fc2" of a LayerNormMLP, "" for a
one-GEMM layer), the role (input, weight, output, grad_output), the slot's scale, the amax the
slot recorded (H[0] after the cast; under current scaling the amax its scale came from), the true
amax of the high-precision tensor that was cast, the fractions of its elements that saturate
(|x * scale| > the format's max) and that underflow to zero (x != 0, FP8 value 0), and the cast's
SQNR in dB. A fused cast (norm, GELU, dGELU) never writes its high-precision tensor: the
statistics kernel recomputes it from the fused kernel's inputs in that kernel's arithmetic, so
the true amax of a correct kernel equals the recorded one exactly.

FP8 attention (fp8_dpa; layer "...core_attention", GEMM "attention"): dO's cast ("grad_output")
and, with separate q, k, v inputs, the casts of q, k and v ("q", "k", "v") as any other; the
casts that happen inside kernels whose high-precision tensor never exists - q and k rotated by
the RoPE + FP8 kernel (and v beside them), O, dQ, dK, dV inside cuDNN - give their scale and
recorded amax only (true amax, saturation, underflow and SQNR empty). S and dP, quantized inside
cuDNN, are not reported.

Cost: while disabled, one empty kernel launch per cast (a node of the graph); while enabled, one
read of each cast's input. Each slot keeps the statistics of its latest cast: collect after every
microbatch (with make_graphed_step, after the step: the last microbatch's activations and
gradients, microbatch 0's weights).
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from graphfp8 import ops
from graphfp8.fp8 import observe
from graphfp8.fp8.observe import StatsSource
from graphfp8.fp8.recipe import fp8_max, is_current_scaling
from graphfp8.fp8.scaling import SlotBlock
from graphfp8.fp8.slots import AttnBwdRole, AttnFwdRole, BwdRole, FwdRole, slots_per_gemm
from graphfp8.graphs.backends import capturing
from graphfp8.modules.attention import DotProductAttention

__all__ = ["FIELDS", "FP8Stats", "plot_stats", "role_digest"]

# One row of FP8Stats.rows().
FIELDS = ("step", "microbatch", "layer", "gemm", "role", "scale", "recorded_amax", "true_amax",
          "saturated_frac", "underflow_frac", "sqnr_db", "numel")  # fmt: skip


@dataclass
class _Slot:
    """One observed slot: where its statistics go and what the rows call it."""

    layer: str
    gemm: str
    role: str
    numel: int
    current: bool  # the recipe is Float8CurrentScaling: recorded amax = scaled_max / scale
    recorded_only: bool  # only scale and recorded amax ("recorded" sources)
    scaled_max: float
    out: torch.Tensor  # (partials, 8) float64 view into a chunk: the latest cast's statistics
    chunk: int  # which chunk of its device, and where in it
    index: int


_CHUNK = 64  # slots per statistics buffer (buffers never move: graphs hold their pointers)


class FP8Stats:
    """Statistics of every FP8 cast of `model`'s graphfp8 layers (see the module docstring).

    Args:
        model: the module holding the layers; rows name layers by their path in it.

    Create it before capturing the model (make_graphed_callables / _microbatch / _step): the
    graphs then hold its (gated) kernels; a model whose FP8 state is already captured raises.
    `close()` (or leaving a `with FP8Stats(model) as stats:` block) removes the observer; graphs
    captured with it keep its kernels, gated off.
    """

    def __init__(self, model: nn.Module):
        for m in model.modules():
            meta = getattr(m, "fp8_meta", None)
            if meta is not None and meta.fwd.arena.frozen:
                raise RuntimeError(
                    "graphfp8.numerics.FP8Stats: the model's FP8 state is already captured in a "
                    "graph, whose casts this observer cannot join; create FP8Stats(model) "
                    "before make_graphed_callables / make_graphed_microbatch / make_graphed_step"
                )
        self.model = model
        self._names: dict[int, tuple[str, nn.Module]] = {}
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._zeros: dict[torch.device, torch.Tensor] = {}  # the x of "recorded" casts
        self._enabled = False
        self._chunks: dict[torch.device, list[torch.Tensor]] = {}  # (_CHUNK, partials, 8) each
        self._collected: list[tuple[int, int, list[_Slot], torch.Tensor]] = []
        self._rows: list[dict] = []
        # The flags and zeros exist before any capture: created inside one, their fill would be
        # a node of the graph (and a CPU tape's record) that every replay runs again.
        for p in itertools.chain(model.parameters(), model.buffers()):
            self._flag(p.device)
            self._zero(p.device)
        self._previous = observe.install(self)

    # Switching -----------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self, on: bool = True) -> None:
        """Switches the statistics kernels on or off (a fill_ of each device flag, only when the
        setting changes; stream-ordered, so a graph replayed after it sees it)."""
        on = bool(on)
        if on != self._enabled:
            for flag in self._flags.values():
                flag.fill_(1.0 if on else 0.0)
        self._enabled = on

    @contextlib.contextmanager
    def record(self, step: int, microbatch: int = 0):
        """Enables the kernels for the block (one microbatch, forward and backward), then
        collects its statistics as (step, microbatch) and switches them off again."""
        was = self._enabled
        self.enable(True)
        try:
            yield self
        finally:
            self.collect(step, microbatch)
            self.enable(was)

    def collect(self, step: int, microbatch: int = 0) -> None:
        """Keeps the statistics of every cast since the last collect as (step, microbatch) and
        clears the buffers: a reduce and a zero_ per 64 slots on the device, no host sync;
        nothing while disabled. (A slot not cast since - a cached weight - has scale 0 there
        and yields no row.)"""
        if not self._enabled:
            return
        for device, chunks in self._chunks.items():
            slots = [s for s in self._slots.values() if s.out.device == device]
            for c, chunk in enumerate(chunks):
                mine = sorted((s for s in slots if s.chunk == c), key=lambda s: s.index)
                if mine:
                    reduced = ops.reduce_cast_stats(chunk[: mine[-1].index + 1])
                    self._collected.append((step, microbatch, mine, reduced))
                chunk.zero_()

    def close(self) -> None:
        """Removes the observer (graphs captured with it keep their kernels, switched off)."""
        self.enable(False)
        if observe.observer() is self:
            observe.install(self._previous)

    def __enter__(self) -> FP8Stats:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # observe.Observer ----------------------------------------------------------------------------

    def cast(self, block: SlotBlock, i: int, role: str, source: StatsSource) -> None:
        arena, s = block.arena, block.start + i
        slot = self._slots.get((arena.serial, s))
        if slot is None:
            owner = self._owner(block)
            if owner is None:
                return  # a module of another model
            slot = self._new_slot(owner, block, i, role, source)
        if source.mode == "recorded":  # a constant zero: the kernel writes scale and amax only
            source = StatsSource("identity", self._zero(source.x.device))
        ops.cast_stats(
            source.x, block.scale(i), block.amax(i), arena.fp8_dtype, mode=source.mode,
            act_in=source.act_in, mu=source.mu, rsigma=source.rsigma, gamma=source.gamma,
            beta=source.beta, zero_centered_gamma=source.zero_centered_gamma,
            enabled=self._flag(source.x.device), skip=source.skip, out=slot.out,
        )  # fmt: skip

    def _zero(self, device: torch.device) -> torch.Tensor:
        zero = self._zeros.get(device)
        if zero is None:
            _not_capturing(f"a zero tensor on {device}")
            zero = self._zeros[device] = torch.zeros(1, device=device)
        return zero

    def _flag(self, device: torch.device) -> torch.Tensor:
        flag = self._flags.get(device)
        if flag is None:
            _not_capturing(f"the enable flag on {device}")
            flag = torch.full((1,), 1.0 if self._enabled else 0.0, device=device)
            self._flags[device] = flag
        return flag

    def _new_slot(self, owner, block: SlotBlock, i: int, role: str, source) -> _Slot:
        name, module = owner
        arena = block.arena
        backward = block is module.fp8_meta.bwd
        names = getattr(module, "gemm_names", ())
        per = slots_per_gemm(BwdRole if backward else FwdRole)
        if isinstance(module, DotProductAttention):  # one unit of AttnFwdRole / AttnBwdRole
            names, per = ("attention",), slots_per_gemm(AttnBwdRole if backward else AttnFwdRole)
        device = source.x.device
        chunks = self._chunks.setdefault(device, [])
        taken = sum(1 for s in self._slots.values() if s.out.device == device)
        c, j = divmod(taken, _CHUNK)
        if c == len(chunks):  # zeros: a slot not cast before the next collect yields no row
            _not_capturing(f"a statistics buffer for {name}'s {role} cast")
            chunks.append(torch.zeros(_CHUNK, ops.stats_partials(device),
                                      len(ops.stats.STATS_COLUMNS), dtype=torch.float64,
                                      device=device))  # fmt: skip
        slot = _Slot(
            layer=name, gemm=names[i // per] if names else "", role=role,
            numel=source.x.numel(), current=is_current_scaling(arena.recipe),
            recorded_only=source.mode == "recorded",
            scaled_max=fp8_max(arena.fp8_dtype) * 2.0**-arena.recipe.margin,  # as Arena.grow
            out=chunks[c][j], chunk=c, index=j,
        )  # fmt: skip
        self._slots[(arena.serial, block.start + i)] = slot
        return slot

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
        """Every collected cast as a dict of FIELDS (one host sync for everything collected since
        the last call)."""
        for step, mb, slots, values in self._collected:
            for slot, v in zip(slots, values.cpu().tolist(), strict=True):
                if v[6] != 0.0:  # scale 0: the slot was not cast in that microbatch
                    self._rows.append(_row(step, mb, slot, v))
        self._collected.clear()
        return list(self._rows)

    def write_csv(self, path) -> Path:
        """Writes rows() to `path` as CSV; returns the path."""
        return write_rows_csv(path, FIELDS, self.rows())


def _not_capturing(what: str) -> None:
    """Raises if a graph capture is recording: FP8Stats allocates its buffers before capture.

    Why a capture never needs one: the flags and zeros are made in __init__ for every device of
    the model's parameters and buffers, and a slot's statistics buffer at the slot's first
    observed cast. Every cast a capture runs, its warmup ran first (an FP8 capture needs
    num_warmup_iters >= 1, graphs/options.py) with this observer already installed (__init__
    refuses a model whose arenas a capture froze), so the capture finds every buffer made. This
    check keeps a break of that argument loud: an allocation inside a capture would put its
    fill into the graph, which every replay would run again.
    """
    if capturing():
        raise RuntimeError(
            f"graphfp8.numerics.FP8Stats: {what} would be allocated inside a graph capture; "
            "run the cast once eagerly (or in the capture's warmup) with the FP8Stats installed "
            "before capturing it"
        )


def write_rows_csv(path, fields: list[str], rows: list[dict]) -> Path:
    """Writes `rows` (dicts keyed by `fields`) to `path` as CSV with a header; returns the path."""
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _row(step: int, mb: int, slot: _Slot, v: list[float]) -> dict:
    amax, sat, under, nonzero, signal, noise, scale, recorded = v
    if slot.current:  # H[0] is consumed by the per-cast update: the scale says what it was
        recorded = slot.scaled_max / scale if scale else math.inf
    if noise > 0:
        sqnr = 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf
    else:
        sqnr = math.inf
    row = {
        "step": step, "microbatch": mb, "layer": slot.layer, "gemm": slot.gemm, "role": slot.role,
        "scale": scale, "recorded_amax": recorded, "true_amax": amax,
        "saturated_frac": sat / slot.numel if slot.numel else 0.0,
        "underflow_frac": under / nonzero if nonzero else 0.0,
        "sqnr_db": sqnr, "numel": slot.numel,
    }  # fmt: skip
    if slot.recorded_only:  # the cast's own statistics were not taken
        row.update(true_amax=None, saturated_frac=None, underflow_frac=None, sqnr_db=None)
    return row


def _role(r: dict) -> str:
    """The role key of a row across layers: "fc1.input", or "input" for a one-GEMM layer."""
    return f"{r['gemm']}.{r['role']}" if r["gemm"] else r["role"]


def role_digest(rows: list[dict]) -> dict[str, dict]:
    """Per role (over layers, steps and microbatches): casts, mean and max saturated fraction,
    mean underflow fraction, mean and min SQNR over the finite ones (None without any), how
    many casts recorded an amax other than the true one (0 for correct kernels), and the max
    recorded amax. A role of scale-and-amax rows only has None for the statistics it lacks."""
    by_role: dict[str, list[dict]] = {}
    for r in rows:
        by_role.setdefault(_role(r), []).append(r)
    digest = {}
    for key, rs in sorted(by_role.items()):
        full = [r for r in rs if r["true_amax"] is not None]
        sat = [r["saturated_frac"] for r in full]
        sqnr = [r["sqnr_db"] for r in full if math.isfinite(r["sqnr_db"])]
        digest[key] = {
            "casts": len(rs), "saturated_mean": sum(sat) / len(sat) if sat else None,
            "saturated_max": max(sat) if sat else None,
            "underflow_mean": sum(r["underflow_frac"] for r in full) / len(full) if full else None,
            "sqnr_mean_db": sum(sqnr) / len(sqnr) if sqnr else None,
            "sqnr_min_db": min(sqnr) if sqnr else None,
            "amax_mismatches": sum(r["recorded_amax"] != r["true_amax"] for r in full),
            "recorded_amax_max": max(r["recorded_amax"] for r in rs),
        }  # fmt: skip
    return digest


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
        series.setdefault(_role(r), {}).setdefault(r["step"], []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("saturated_frac", "saturated fraction"), ("underflow_frac", "underflow fraction"),
              ("sqnr_db", "SQNR (dB)"))  # fmt: skip
    for key, by_step in sorted(series.items()):
        steps = sorted(by_step)
        for ax, (field, _) in zip(axes, panels, strict=True):
            finite = [[r[field] for r in by_step[s] if r[field] is not None and
                       math.isfinite(r[field])] for s in steps]  # fmt: skip
            vals = [sum(f) / len(f) if f else math.nan for f in finite]
            ax.plot(steps, vals, label=key)
    for ax, (field, title) in zip(axes, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        if field != "sqnr_db":
            ax.set_yscale("symlog", linthresh=1e-6)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
