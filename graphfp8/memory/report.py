"""The memory report: where a model's memory goes, by category, each tensor storage counted once -
parameters, grads (graphed runs' persistent .grad buffers included), FP8 weight workspaces
(data, transpose, scale_inv), FP8 arenas, buffers, the graphs' static inputs/outputs, what the
graphs hold (CPU: the storages the replay tapes keep alive; CUDA: the private pools, from
torch.cuda.memory_snapshot()) and what the autograd graph behind some outputs saves for backward,
node by node. On CUDA it also records what torch.cuda measured."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from graphfp8.memory.ledger import Ledger
from graphfp8.memory.saved import SAVED, NodeSaves, walk_saved
from graphfp8.modules.base import FP8Module

__all__ = ["CATEGORIES", "MemoryReport", "memory_report"]

PARAMS, GRADS, FP8_WEIGHTS, ARENAS = "parameters", "grads", "FP8 weights", "FP8 arenas"
BUFFERS, OTHER, GRAPH_IO = "buffers", "other", "graph inputs/outputs"
GRAPH_GRADS, GRAPH_HELD = "graph param grads", "graph tapes"
# Claim order: a storage found under several names counts under the first.
CATEGORIES = (PARAMS, GRADS, FP8_WEIGHTS, ARENAS, BUFFERS, OTHER, GRAPH_IO, GRAPH_GRADS,
              GRAPH_HELD, SAVED)  # fmt: skip
MiB = 2**20


@dataclass
class MemoryReport:
    """Bytes by category (storages counted once), the saved tensors of each autograd node, and
    on CUDA the pools and the allocator's own counters.

    Attributes:
        device: the model's device.
        bytes: {category: bytes of the storages counted there}.
        blocks: the same rounded up the way the CUDA caching allocator rounds each block.
        items: {category: [Claim]} the storages counted there.
        saved: what each autograd node behind the given outputs keeps for backward.
        pools: CUDA: {pool: {"reserved", "allocated", "tensors"}}, "default" for the ordinary
            pool and "graph <id>" for a graph pool; "tensors" = bytes of the report's storages
            that live there. Empty on the CPU.
        cuda: CUDA: allocated, reserved and their peaks (torch.cuda.*memory_*); None on the CPU.
    """

    device: str
    bytes: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)
    items: dict = field(default_factory=dict)
    saved: list[NodeSaves] = field(default_factory=list)
    pools: dict = field(default_factory=dict)
    cuda: dict | None = None

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def to_dict(self, with_items: bool = True) -> dict:
        out = {"device": self.device, "bytes": dict(self.bytes), "blocks": dict(self.blocks),
               "total": self.total, "pools": self.pools, "cuda": self.cuda}  # fmt: skip
        if with_items:
            out["items"] = {k: [c.to_dict() for c in v] for k, v in self.items.items()}
            out["saved"] = [n.to_dict() for n in self.saved]
        return out

    def format(self, title: str = "memory") -> str:
        """Markdown: the categories, the CUDA pools, and the saved tensors node by node."""
        lines = [f"### {title}", "", "| category | MiB | storages |", "| --- | --- | --- |"]
        for cat in CATEGORIES:
            if self.bytes.get(cat):
                lines.append(f"| {cat} | {self.bytes[cat] / MiB:.2f} | {len(self.items[cat])} |")
        lines.append(f"| total (each storage once) | {self.total / MiB:.2f} | |")
        if self.cuda:
            c = self.cuda
            lines += ["", f"torch.cuda: allocated {c['allocated'] / MiB:.1f} MiB (peak "
                      f"{c['max_allocated'] / MiB:.1f}), reserved {c['reserved'] / MiB:.1f} MiB "
                      f"(peak {c['max_reserved'] / MiB:.1f})"]  # fmt: skip
            for name, p in self.pools.items():
                lines.append(
                    f"- pool {name}: reserved {p['reserved'] / MiB:.1f} MiB, allocated "
                    f"{p['allocated'] / MiB:.1f}, report's tensors {p['tensors'] / MiB:.1f}"
                )
        if self.saved:
            lines += ["", *_saved_table(self.saved)]
        text = "\n".join(lines) + "\n"
        return text


def _saved_table(saved: list[NodeSaves]) -> list[str]:
    """One row per storage a node is the first to hold, and one row per node for the storages
    it only refers to (parameters, FP8 weights, arenas, tensors an earlier node saved)."""
    lines = ["| node | saved tensor | shape | dtype | MiB |", "| --- | --- | --- | --- | --- |"]
    for n in saved:
        node = f"{n.module} {n.node}" if n.module else n.node
        refs: dict[str, set] = {}
        for c in n.tensors:
            if c.counted:
                lines.append(f"| {node} | {c.label} | {tuple(c.shape)} | {c.dtype} | "
                             f"{c.nbytes / MiB:.3f} |")  # fmt: skip
            else:
                refs.setdefault(c.owner, set()).add(c.label)
        if refs:
            text = ", ".join(f"{owner} x{len(labels)}" for owner, labels in refs.items())
            lines.append(f"| {node} | refers to: {text} | | | |")
    return lines


def memory_report(model: torch.nn.Module, outputs=None, graphed=(), other=None) -> MemoryReport:
    """Accounts for the memory of `model` and of what hangs off it.

    Args:
        model: the module (parameters, grads, FP8 workspaces and arenas, buffers).
        outputs: tensors whose autograd graph is walked for saved tensors (None: no walk).
        graphed: graphed callables of make_graphed_callables over parts of the model (their
            static buffers and what their graphs hold).
        other: {name: tensor} that the caller holds and wants counted (inputs, grads of them).

    Returns:
        A MemoryReport; on CUDA with the pools and torch.cuda's counters.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"memory_report: model must be an nn.Module, got {type(model).__name__}")
    runners = [_runner_of(g) for g in graphed]
    if any(r is None for r in runners):
        kinds = [type(g).__name__ for g, r in zip(graphed, runners, strict=True) if r is None]
        raise TypeError(
            f"memory_report: graphed= takes what make_graphed_callables returned, got {kinds} "
            "that no graph backs (nothing of them would be counted)"
        )
    ledger = Ledger()
    device = _device(model)
    _claim_model(model, ledger)
    for name, t in (other or {}).items():
        if isinstance(t, torch.Tensor):
            ledger.claim(t, OTHER, name)
    for i, runner in enumerate(runners):
        _claim_runner(runner, i, ledger)
    saved = walk_saved(outputs, ledger) if outputs is not None else []
    report = MemoryReport(device=str(device), saved=saved)
    report.bytes = {c: ledger.bytes[c] for c in CATEGORIES if ledger.bytes.get(c)}
    report.blocks = {c: ledger.blocks[c] for c in report.bytes}
    report.items = {c: list(ledger.items[c]) for c in report.bytes}
    if device.type == "cuda":
        report.pools = _pools(device, runners, ledger)
        report.cuda = cuda_counters(device)
    return report


def cuda_counters(device) -> dict:
    """torch.cuda's allocated/reserved bytes and their peaks on `device`."""
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
    }


def _device(model: torch.nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _claim_model(model: torch.nn.Module, ledger: Ledger) -> None:
    params = list(model.named_parameters())
    for name, p in params:
        ledger.claim(p, PARAMS, name)
    for name, p in params:
        if p.grad is not None:
            ledger.claim(p.grad, GRADS, f"{name}.grad")
        buffer = getattr(p, "_graphfp8_grad", None)  # a graphed run's persistent .grad
        if buffer is not None:
            ledger.claim(buffer, GRADS, f"{name} graph .grad buffer")
    arenas, stale = {}, []
    for mname, m in model.named_modules():
        if not isinstance(m, FP8Module):
            continue
        for key, ws in m.weight_cache.workspaces.items():
            ledger.claim(ws, FP8_WEIGHTS, f"{mname}.{key}" if mname else key)
        if m.fp8_meta is not None:
            for block in (m.fp8_meta.fwd, m.fp8_meta.bwd):
                arenas[id(block.arena)] = block.arena
            for block in (m.fp8_meta.fwd, m.fp8_meta.bwd):
                # Cached per-slot views; after the arena grew they may still point at its
                # previous tensors (until the module's next FP8 call refreshes them).
                for t in block._scales + block._amaxes:
                    stale.append((t, f"{mname} slot view"))
    for arena in arenas.values():
        for attr in ("amax_history", "scale", "scaled_max", "amax_sink"):
            ledger.claim(getattr(arena, attr), ARENAS, f"{arena.direction} arena {attr}")
    for t, label in stale:
        ledger.claim(t, ARENAS, label)
    for name, b in model.named_buffers():
        ledger.claim(b, BUFFERS, name)


def _runner_of(graphed):
    """The graph pair of a graphed callable (graphs/runner.py GraphPair), or None."""
    runner = getattr(graphed, "graphed_runner", None) or getattr(graphed, "runner", None)
    return None if runner is None else runner.pair


def _graphs_of(runner) -> list:
    """Every backend graph of a graph pair (forward, backward, gradient folds), found by
    type."""
    holders = [runner] + [v for v in vars(runner).values() if hasattr(v, "__dict__")]
    found = []
    for holder in holders:
        for value in vars(holder).values():
            if (hasattr(value, "tape") or hasattr(value, "graph")) and hasattr(value, "replay"):
                if all(value is not g for g in found):
                    found.append(value)
    return found


def _claim_runner(runner, i: int, ledger: Ledger) -> None:
    groups = (("input", runner.static_inputs), ("output", runner.static_outputs),
              ("grad output", runner.static_grad_outputs),
              ("grad input", runner.static_grad_inputs))  # fmt: skip
    for what, tensors in groups:
        for j, t in enumerate(tensors or ()):
            if isinstance(t, torch.Tensor):
                ledger.claim(t, GRAPH_IO, f"callable {i} static {what} {j}")
    # Gradients the backward graph leaves in static buffers for a fold into .grad.
    for j, t in enumerate(getattr(runner.accumulator, "grads", None) or ()):
        if isinstance(t, torch.Tensor):
            ledger.claim(t, GRAPH_GRADS, f"callable {i} static param grad {j}")
    for graph in _graphs_of(runner):
        tape = getattr(graph, "tape", None)
        if tape is None:
            continue
        for r, record in enumerate(tape.records):
            for t in tree_flatten((record.args, record.kwargs, record.outs))[0]:
                if isinstance(t, torch.Tensor):
                    ledger.claim(t, GRAPH_HELD, f"callable {i} tape op {r} {record.func}")


def _pools(device: torch.device, runners, ledger: Ledger) -> dict:
    """Reserved and allocated bytes of the default pool and of every graph pool on `device`,
    the bytes of the report's storages that live in each, and "captured": True on the pools
    that the given runners' graphs use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device", index) == index]
    pools: dict[str, dict] = {}
    spans = []
    for seg in segments:
        pid = tuple(seg["segment_pool_id"])
        name = "default" if pid == (0, 0) else f"graph {pid[0]}.{pid[1]}"
        p = pools.setdefault(name, {"reserved": 0, "allocated": 0, "tensors": 0})
        p["reserved"] += seg["total_size"]
        p["allocated"] += seg["allocated_size"]
        spans.append((seg["address"], seg["address"] + seg["total_size"], name))
    for runner in runners:
        for graph in _graphs_of(runner):
            if isinstance(getattr(graph, "graph", None), torch.cuda.CUDAGraph):
                pid = tuple(graph.graph.pool())
                name = "default" if pid == (0, 0) else f"graph {pid[0]}.{pid[1]}"
                pools.setdefault(name, {"reserved": 0, "allocated": 0, "tensors": 0})
                pools[name]["captured"] = True
    for (_, ptr), nbytes in ledger.sizes.items():
        for lo, hi, name in spans:
            if lo <= ptr < hi:
                pools[name]["tensors"] += nbytes
                break
    return pools
