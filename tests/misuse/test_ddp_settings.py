"""graphfp8-train --ddp refuses ranks started with different settings (issue 25, row 9): every
rank prints one line naming each difference and exits with 2 before training (it trained, said
the ranks were identical, and counted rank 0's tokens)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from graphfp8 import distributed
from graphfp8.training import cli as train
from tests.rank_pool import run_on_ranks

SMALL = ["--batch", "2", "--microbatches", "1", "--steps", "2", "--device", "cpu", "--ddp"]


def _main_on_this_rank(argv: list[str]) -> tuple[int, str]:
    """train.main(argv) as torchrun would start it, in the rank pool's process group (kept:
    main's cleanup is skipped)."""
    env, cleanup = os.environ.get("WORLD_SIZE"), distributed.cleanup
    os.environ["WORLD_SIZE"] = "2"
    distributed.cleanup = lambda: None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = train.main(argv)
    finally:
        distributed.cleanup = cleanup
        if env is None:
            del os.environ["WORLD_SIZE"]
    return code, err.getvalue()


def _different_seq_len(rank, device, out):
    seq = "32" if rank == 0 else "48"
    code, err = _main_on_this_rank([*SMALL, "--seq-len", seq, "--out", f"{out}/{rank}"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"graphfp8-train: error (rank {rank}): the ranks were started "
                               "with different settings")  # fmt: skip
    assert "seq_len: rank 0 32, rank 1 48" in lines[0]
    written = [p for p in Path(out).rglob("*") if p.is_file()]
    assert not written, f"wrote {written}"  # (rank 0 created its --out folder, checked writable)


def _different_data(rank, device, out):
    path = f"{out}/text{rank}.txt"
    with open(path, "w") as f:
        f.write(("abcdefgh" if rank == 0 else "hgfedcba") * 4000)
    code, err = _main_on_this_rank([*SMALL, "--seq-len", "32", "--data", path])
    assert code == 2 and "data contents: rank 0 {" in err, err


def _unreadable_data_on_one_rank(rank, device, out):
    """Rank 1 cannot read its data: both ranks stop with the reason (rank 0 waited for it)."""
    path = f"{out}/text.txt"
    if rank == 0:
        with open(path, "w") as f:
            f.write("abcdefgh" * 4000)
    code, err = _main_on_this_rank([*SMALL, "--seq-len", "32", "--data",
                                    path if rank == 0 else f"{out}/missing.txt"])  # fmt: skip
    assert code == 2 and "data contents: rank 0 {" in err and "rank 1 'unreadable'" in err, err


@pytest.mark.parametrize(
    "worker", [_different_seq_len, _different_data, _unreadable_data_on_one_rank],
    ids=["seq-len", "data", "unreadable data"],
)  # fmt: skip
def test_ranks_with_different_settings_are_refused(worker, tmp_path):
    run_on_ranks("gloo", worker, str(tmp_path))
