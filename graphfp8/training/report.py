"""What a training run shows and writes: a progress bar, the CSV/JSON logs, the loss plot."""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path

__all__ = ["Progress", "MetricsLog", "write_summary", "plot_losses", "final_loss"]


class Progress:
    """A one-line progress bar on stderr (a plain line per update when stderr is not a TTY).

    Args:
        total: steps in the run.
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
    """Appends one CSV row per step to `<out>/<run>.csv`."""

    FIELDS = ("step", "loss", "lr", "tokens", "elapsed_s", "tokens_per_s")

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


def write_summary(out: Path, summary: dict) -> Path:
    path = out / "summary.json"
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def plot_losses(curves: dict[str, list[float]], path: Path, title: str) -> Path:
    """Loss curves of several runs in one PNG.

    Args:
        curves: {run name: loss per step}.
        path: where the PNG goes.
        title: the plot title (preset, steps, device).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross entropy, nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
