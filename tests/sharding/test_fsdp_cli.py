"""graphfp8-train --ddp --fsdp (cli.main on the rank pool's 2 gloo ranks, as torchrun would start
it): eager training of the GPT under FSDP2 with FP8 weights - the loss falls, the ranks agree,
each rank's memory is in summary.json and holds about half of the state - and every option it
does not run (graph modes, --shard, --save, --check-replicas, --compile) refused before
anything starts."""

from __future__ import annotations

import json
from pathlib import Path

from tests.rank_pool import run_on_ranks
from tests.sharding.common import run_cli

ARGS = ["--device", "cpu", "--ddp", "--fsdp", "--fp8-weights", "--batch", "2", "--seq-len", "32",
        "--microbatches", "2", "--data", "synthetic", "--val-batches", "1", "--log-every",
        "2"]  # fmt: skip


def _eager(rank, device, tmp):
    code, stdout, err = run_cli([*ARGS, "--graphs", "none", "--steps", "4", "--out", tmp])
    assert code == 0, err
    if rank != 0:
        return
    run = json.loads((Path(tmp) / "summary.json").read_text())["runs"][0]
    assert run["name"].startswith("fp8-fp8w-") and run["name"].endswith("-fsdp")
    assert run["ranks_agree"] == {"fp8_state": True, "parameters": True, "val_loss": True}
    assert run["losses"][-1] < run["losses"][0]
    state = [m["state"]["bytes"] for m in run["memory_per_rank"]]
    assert len(state) == 2
    for key in ("weights", "fp32 masters", "optimizer state"):  # sharded: about half each
        total = sum(s[key] for s in state)
        assert all(0.3 < s[key] / total < 0.7 for s in state), (key, state)
    assert "B/param of state" in stdout


def test_fsdp_trains_eagerly(tmp_path):
    run_on_ranks("gloo", _eager, str(tmp_path))


REFUSALS = [
    ([], "graph capture of an FSDP2 model is not supported"),
    (["--graphs", "step"], "graph capture of an FSDP2 model is not supported"),
    (["--graphs", "none", "--shard"], "two ways to shard"),
    (["--graphs", "none", "--save", "ckpt.pt"], "dcp_checkpoint"),
    (["--graphs", "none", "--check-replicas"], "FSDP2's are sharded"),
    (["--graphs", "none", "--compile"], "--compile with --fsdp"),
]


def _refused(rank, device, tmp):
    for extra, message in REFUSALS:
        code, _, err = run_cli([*ARGS, *extra, "--steps", "2", "--out", tmp])
        assert code == 2 and message in err, (extra, code, err)
    assert not Path(tmp).exists() or not any(Path(tmp).iterdir())  # nothing started


def test_what_fsdp_does_not_run_is_refused(tmp_path):
    run_on_ranks("gloo", _refused, str(tmp_path / "out"))
