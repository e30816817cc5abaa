"""Where graphfp8-train writes, checked before it trains: --out (a folder; a fresh subfolder when
it already holds an earlier run's files) and --save (a file), each found writable or refused in
one line, so that no run trains for an hour and then fails to write its results."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["OutputError", "check_outputs", "fresh_out"]


class OutputError(ValueError):
    """--out or --save cannot be written."""


def _probe(folder: Path, what: str, rank: int) -> None:
    """Creates `folder` (and its parents) and a file in it, then removes the file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".graphfp8-write-check-{os.getpid()}-{rank}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OutputError(f"{what}: cannot write in {folder} ({reason})") from None


def check_outputs(out: Path, save: Path | None, rank: int = 0) -> None:
    """Raises OutputError unless the run can write its logs into `out` and its checkpoint to
    `save`. Creates `out` (and the checkpoint's folder); writes nothing else.

    Args:
        out: the log folder (--out).
        save: the checkpoint file (--save), or None.
        rank: this process's rank (probe files of ranks never collide).
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file; --out names a folder for the run's logs")
    _probe(out, f"--out {out}", rank)
    if save is None:
        return
    if save.is_dir():
        raise OutputError(f"--save {save} is a folder; --save names the checkpoint file")
    parent = save.parent
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"--save {save}: {parent} is a file, not a folder")
    _probe(parent, f"--save {save}", rank)
    if save.exists() and not os.access(save, os.W_OK):
        raise OutputError(f"--save {save}: the file exists and cannot be overwritten")


def fresh_out(out: Path, files: list[str], stamp: str) -> tuple[Path, str | None]:
    """The folder this run writes into: `out`, or when `out` already holds one of `files` (an
    earlier run's summary.json or CSV log), a fresh subfolder `out/<stamp>[-N]`.

    Returns:
        (folder, a note saying where the run writes instead, or None).
    """
    if not out.is_dir() or not any((out / f).exists() for f in files):
        return out, None
    fresh, n = out / stamp, 1
    while fresh.exists():
        n += 1
        fresh = out / f"{stamp}-{n}"
    held = sorted(f for f in files if (out / f).exists())
    return fresh, (f"--out {out} holds an earlier run ({', '.join(held)}); this run writes to "
                   f"{fresh}")  # fmt: skip
