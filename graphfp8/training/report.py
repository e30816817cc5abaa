"""What a training run shows and writes: a progress bar, the CSV/JSON logs, the results table,
every rank's memory and the loss plot."""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from graphfp8.distributed import gather_objects
from graphfp8.memory.state import training_state
from graphfp8.training.speed import baseline_of

__all__ = ["environment", "Progress", "MetricsLog", "write_summary", "plot_losses", "final_loss",
           "print_table", "print_memory", "print_ranks", "rank_memory"]  # fmt: skip


class Progress:
    """A one-line progress bar on stderr (a plain line per update when stderr is not a TTY).

    Args:
        total: steps in the run (a resumed run counts from its start: 9/12, not 3/6).
        desc: the run's name.
        enabled: False prints nothing (ranks other than 0).
    """

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def update(self, done: int, **fields) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * done / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        info = "  ".join(f"{k} {v}" for k, v in fields.items())
        elapsed = time.perf_counter() - self.start
        line = f"{self.desc:>12} [{bar}] {done}/{self.total}  {info}  {elapsed:.0f}s"
        if self.tty:
            end = "\n" if done >= self.total else ""
            print("\r" + line, end=end, file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


class MetricsLog:
    """Appends one CSV row per step to `<out>/<run>.csv` (val_loss only on validation steps)."""

    FIELDS = ("step", "loss", "val_loss", "lr", "tokens", "elapsed_s", "tokens_per_s")

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.FIELDS)
        self._writer.writeheader()

    def write(self, row: dict) -> None:
        self._writer.writerow({k: row[k] for k in self.FIELDS})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def final_loss(losses: list[float]) -> float:
    """Mean of the last 10% of the steps (at least one): less noisy than the last step."""
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def environment(device: str) -> dict:
    """torch, Python, the device and (CUDA) the GPU's name and CUDA version, for summary.json."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env


def write_summary(out: Path, summary: dict) -> Path:
    path = out / "summary.json"
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def print_table(results: list[dict]) -> None:
    """The runs side by side against the baseline (training/speed.py's baseline_of: the compiled
    bf16 run, else the first): final training and validation loss, the validation loss against
    the baseline's, tokens/s (the median over the steady log intervals' min-max), the speed-up
    over the baseline, model TFLOP/s and the fraction of the physical floor reached."""
    base = baseline_of(results)
    peer = base.get("peer") or {}
    print(f"\nbaseline: {base['name']} (graphed: {peer.get('graphed', '?')}, compiled: "
          f"{peer.get('compiled', '?')}); every ratio is over it")  # fmt: skip
    print(f"{'run':>18} {'train loss':>10} {'val loss':>9} {'vs base':>9} {'tokens/s':>12} "
          f"{'min-max':>17} {'speed-up':>8} {'model TF/s':>10} {'floor':>6}")  # fmt: skip
    for r in results:
        val, base_val = r.get("final_val_loss"), base.get("final_val_loss")
        val_text = f"{val:>9.4f}" if val is not None else f"{'-':>9}"
        diff = f"{'-':>9}"
        if val is not None and base_val:
            diff = f"{(val / base_val - 1) * 100:>+8.2f}%"
        tps, base_tps = r["tokens_per_s"], base["tokens_per_s"]
        tps_text = f"{tps:>12,.0f}" if tps else f"{'-':>12}"  # None: too few steps to time
        spread = r.get("tokens_per_s_spread")
        spread_text = f"{spread['min']:,.0f}-{spread['max']:,.0f}" if spread else "-"
        speed = f"{tps / base_tps:>7.2f}x" if tps and base_tps else f"{'-':>8}"
        tflops = f"{r['model_tflops']:>10.1f}" if r.get("model_tflops") else f"{'-':>10}"
        frac = f"{r['floor_fraction']:>6.3f}" if r.get("floor_fraction") else f"{'-':>6}"
        print(f"{r['name']:>18} {r['final_loss']:>10.4f} {val_text} {diff} {tps_text} "
              f"{spread_text:>17} {speed} {tflops} {frac}")  # fmt: skip


def rank_memory(run, group) -> list[dict]:
    """Every rank's memory (a collective with a group): {"rank", "max_allocated_bytes"
    (torch.cuda's peak over the run; None on the CPU), "state": graphfp8.memory's
    training_state (bytes and bytes per parameter by category)}, in rank order."""
    peak = torch.cuda.max_memory_allocated() if run.spec.device.startswith("cuda") else None
    state = training_state(run.model, run.optimizer, run.masters).to_dict()
    mine = {"rank": run.rank, "max_allocated_bytes": peak, "state": state}
    if group is None:
        return [mine]
    every = gather_objects(mine, group)
    return every


def print_ranks(results: list[dict], world: int) -> None:
    """Data parallel runs: whether the ranks ended with the same FP8 state, parameters and
    validation loss, (--check-replicas) at how many checks their weights were identical, and
    (every run) each rank's memory (print_memory)."""
    for r in results:
        if r["ranks_agree"] is not None:
            agree = ", ".join(f"{k} {'identical' if v else 'DIFFERENT'}"
                              for k, v in r["ranks_agree"].items())  # fmt: skip
            print(f"{r['name']}: across {world} ranks: {agree}")
        if r.get("replicas") is not None:
            print(
                f"{r['name']}: --check-replicas: the weights identical on all {world} ranks at "
                f"{r['replicas']['steps_checked']} checks (the start and every step)"
            )
    print_memory(results)


def print_memory(results: list[dict]) -> None:
    """One line per run and rank: bytes per parameter of the training state, by category, and
    the measured peak."""
    for r in results:
        for m in r.get("memory_per_rank") or ():
            per = m["state"]["bytes_per_parameter"]
            parts = ", ".join(f"{k} {v:.2f}" for k, v in per.items() if k != "total" and v)
            peak = m["max_allocated_bytes"]
            peak_text = f"; max_allocated {peak / 2**30:.2f} GiB" if peak is not None else ""
            print(f"{r['name']} rank {m['rank']}: {per['total']:.2f} B/param of state "
                  f"({parts}){peak_text}")  # fmt: skip


def plot_losses(results: list[dict], path: Path, title: str) -> Path:
    """Training (lines) and validation (dashed, with markers) loss curves of several runs.

    Args:
        results: train_run() results: "name", "first_step", "losses" (per step) and
            "val_losses" ([step, loss] pairs).
        path: where the PNG goes.
        title: the plot title (preset, steps, data, device).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for r in results:
        first, losses = r.get("first_step", 0), r["losses"]
        (line,) = ax.plot(range(first + 1, first + len(losses) + 1), losses,
                          label=f"{r['name']} train", linewidth=1.0, alpha=0.8)  # fmt: skip
        if r.get("val_losses"):
            steps, vals = zip(*r["val_losses"], strict=True)
            ax.plot(steps, vals, "--o", color=line.get_color(), markersize=3, linewidth=1.2,
                    label=f"{r['name']} validation")  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (cross entropy, nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
