"""graphfp8-train --ddp --fsdp (cli.main on the rank pool's 2 gloo ranks, as torchrun would start
it): training of the GPT under FSDP2 with FP8 weights - the loss falls, the ranks agree, each
rank's memory is in summary.json and holds about half of the state - on HSDP's 2-D mesh too
(--hsdp 2 on 4 ranks: two replicas of 2 shards); --graphs step and --graphs layers equal to
eager bit for bit, --graphs step with --fsdp-sync last too (one reduce-scatter per step),
--graphs layers with --recompute full, with --fsdp-sync last and with --fsdp-prefetch too; and
every option it does not run (--shard, --save, --check-replicas, --compile, --hsdp, --fsdp-sync
or --fsdp-prefetch without --fsdp, --hsdp not dividing the ranks) refused before anything
starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rank_pool import run_on_ranks
from tests.sharding.common import run_cli, world

ARGS = ["--device", "cpu", "--ddp", "--fsdp", "--fp8-weights", "--batch", "2", "--seq-len", "32",
        "--microbatches", "2", "--data", "synthetic", "--val-batches", "1", "--log-every",
        "2"]  # fmt: skip


def _eager(rank, device, tmp, extra, suffix, shards):
    code, stdout, err = run_cli([*ARGS, *extra, "--graphs", "none", "--steps", "4", "--out", tmp])
    assert code == 0, err
    if rank != 0:
        return
    run = json.loads((Path(tmp) / "summary.json").read_text())["runs"][0]
    assert run["name"].startswith("fp8-fp8w-") and run["name"].endswith(suffix)
    # parameters: every rank's whole model (FSDP2's full_tensor), the replicas' included
    assert run["ranks_agree"] == {"fp8_state": True, "parameters": True, "val_loss": True}
    assert run["losses"][-1] < run["losses"][0]
    state = [m["state"]["bytes"] for m in run["memory_per_rank"]]
    assert len(state) == world()
    for key in ("weights", "fp32 masters", "optimizer state"):  # 1 / shards of each on a rank
        total = sum(s[key] for s in state[:shards])  # the first replica's ranks: the whole
        assert all(0.6 / shards < s[key] / total < 1.4 / shards for s in state), (key, state)
    assert "B/param of state" in stdout


def test_fsdp_trains_eagerly(tmp_path):
    run_on_ranks("gloo", _eager, str(tmp_path), [], "-fsdp", 2)


def test_hsdp_trains_eagerly(tmp_path):
    """4 ranks, --hsdp 2: each rank holds half the state (not a quarter), and the replicas'
    weights are the same (ranks_agree)."""
    run_on_ranks("gloo", _eager, str(tmp_path), ["--hsdp", "2"], "-fsdp-hsdp2", 2, world=4)


def _eager_equals_step_graph(rank, device, tmp, extra=(), suffix="-step-fsdp", graphed="step"):
    runs = {}
    for mode in ("none", graphed):
        out = f"{tmp}/{mode}"
        code, stdout, err = run_cli([*ARGS, *extra, "--graphs", mode, "--steps", "4", "--out",
                                     out])  # fmt: skip
        assert code == 0, err
        if rank == 0:
            runs[mode] = json.loads((Path(out) / "summary.json").read_text())["runs"][0]
    if rank != 0:
        return
    eager, step = runs["none"], runs[graphed]
    assert step["name"].endswith(suffix), step["name"]
    assert step["ranks_agree"] == {"fp8_state": True, "parameters": True, "val_loss": True}
    # The same bits: every step's loss and the validation loss after training (the weights).
    assert step["losses"] == eager["losses"] and step["val_losses"] == eager["val_losses"]
    assert eager["losses"][-1] < eager["losses"][0]
    state = [m["state"]["bytes"] for m in step["memory_per_rank"]]
    assert len(state) == world()
    for key in ("weights", "fp32 masters", "optimizer state"):  # about half of each per rank
        total = sum(s[key] for s in state)
        assert all(0.3 < s[key] / total < 0.7 for s in state), (key, state)


def test_fsdp_step_graph_trains_as_eager(tmp_path):
    """--graphs step: the whole FSDP2 step in one graph (FP8 weights), bit for bit with
    --graphs none."""
    run_on_ranks("gloo", _eager_equals_step_graph, str(tmp_path))


def test_fsdp_layer_graphs_train_as_eager(tmp_path):
    """--graphs layers: a graph pair per FSDP2 layer (FP8 weights), the blocks' root eager
    around them, bit for bit with --graphs none (before: refused)."""
    run_on_ranks("gloo", _eager_equals_step_graph, str(tmp_path), (), "-graphs-fsdp", "layers")


def test_fsdp_layer_graphs_with_recompute_train_as_eager(tmp_path):
    """--graphs layers --recompute full: each FSDP2 layer's backward graph recomputes its forward
    after the all-gather, bit for bit with --graphs none --recompute full (before: refused)."""
    run_on_ranks("gloo", _eager_equals_step_graph, str(tmp_path), ["--recompute", "full"],
                 "-graphs-fsdp-recompute-full", "layers")  # fmt: skip


def test_fsdp_sync_last_layer_graphs_train_as_eager(tmp_path):
    """--graphs layers --fsdp-sync last: each FSDP2 layer's sync graph reduce-scatters after the
    last microbatch's backward, bit for bit with --graphs none --fsdp-sync last (before:
    refused)."""
    run_on_ranks("gloo", _eager_equals_step_graph, str(tmp_path), ["--fsdp-sync", "last"],
                 "-graphs-fsdp-synclast", "layers")  # fmt: skip


@pytest.mark.parametrize("mode, name", [("layers", "graphs"), ("step", "step")])
def test_fsdp_prefetch_trains_as_eager(tmp_path, mode, name):
    """--fsdp-prefetch: with --graphs layers, layer 0's forward graph all-gathers layer 1's
    weights and layer 1's backward graph layer 0's; the step graph holds FSDP2's prefetch as its
    hooks run it; bit for bit with --graphs none --fsdp-prefetch (eager FSDP2's explicit
    prefetch; before: no such option, and per-layer graphs refused it)."""
    run_on_ranks("gloo", _eager_equals_step_graph, str(tmp_path), ["--fsdp-prefetch"],
                 f"-{name}-fsdp-prefetch", mode)  # fmt: skip


def test_fsdp_sync_last_step_graph_trains_as_eager(tmp_path):
    """--fsdp-sync last: one reduce-scatter per step, eagerly and in the step graph, bit for
    bit."""
    run_on_ranks("gloo", _eager_equals_step_graph, str(tmp_path), ["--fsdp-sync", "last"],
                 "-step-fsdp-synclast")  # fmt: skip


REFUSALS = [
    (["--graphs", "none", "--shard"], "two ways to shard"),
    (["--graphs", "none", "--save", "ckpt.pt"], "dcp_checkpoint"),
    (["--graphs", "none", "--check-replicas"], "FSDP2's are sharded"),
    (["--graphs", "none", "--compile"], "--compile with --fsdp"),
    (["--graphs", "none", "--hsdp", "3"], "--hsdp 3: the replicas must divide the 2 ranks"),
]


def _refused(rank, device, tmp):
    for extra, message in REFUSALS:
        code, _, err = run_cli([*ARGS, *extra, "--steps", "2", "--out", tmp])
        assert code == 2 and message in err, (extra, code, err)
    no_fsdp = [a for a in ARGS if a != "--fsdp"]
    code, _, err = run_cli([*no_fsdp, "--graphs", "none", "--hsdp", "2", "--steps", "2", "--out",
                            tmp])  # fmt: skip
    assert code == 2 and "--hsdp replicates FSDP2's shards" in err, (code, err)
    code, _, err = run_cli([*no_fsdp, "--graphs", "none", "--fsdp-sync", "last", "--steps", "2",
                            "--out", tmp])  # fmt: skip
    assert code == 2 and "--fsdp-sync is FSDP2's gradient sync" in err, (code, err)
    code, _, err = run_cli([*no_fsdp, "--graphs", "none", "--fsdp-prefetch", "--steps", "2",
                            "--out", tmp])  # fmt: skip
    assert code == 2 and "--fsdp-prefetch is FSDP2's explicit prefetch" in err, (code, err)
    assert not Path(tmp).exists() or not any(Path(tmp).iterdir())  # nothing started


def test_what_fsdp_does_not_run_is_refused(tmp_path):
    run_on_ranks("gloo", _refused, str(tmp_path / "out"))
