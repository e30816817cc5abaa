"""graphfp8-train options that did nothing or failed late (misuse round, notes/MISUSE.md): FP8
options for runs without FP8 were ignored, --amax-history-len with current scaling was ignored,
--compile with --graphs step raised a traceback after the data was read; a run too short to time
printed 'nan' tokens/s."""

from __future__ import annotations

import pytest

from graphfp8.training import cli as train
from tests.training.common import cli_refusal

FAST = ["--batch", "2", "--seq-len", "32", "--microbatches", "1", "--device", "cpu",
        "--val-batches", "1"]  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["--precision", "bf16", "--fp8-weights"], "--fp8-weights: no run trains in FP8"),
        (["--compare", "bf16:eager,bf16:graphs", "--scaling", "current"], "--scaling: no run"),
        (["--precision", "bf16", "--fp8-format=E4M3"], "--fp8-format: no run trains in FP8"),
        # issue 32, item 7: wrote no statistics and said nothing
        (["--precision", "bf16", "--fp8-stats", "1"], "--fp8-stats: no run trains in FP8"),
        (["--compare", "bf16:eager,bf16:graphs", "--fp8-stats=2"], "--fp8-stats: no run"),
        (["--scaling", "current", "--amax-history-len", "64"], "keeps no history"),
        (["--scaling", "blockwise", "--amax-history-len", "64"], "keeps no history"),
        (["--scaling", "blockwise", "--fp8-format", "HYBRID"], "E4M3 everywhere"),
        (["--scaling", "blockwise", "--fp8-attention"], "DelayedScaling only"),
        (["--compile", "--graphs", "step"], "--compile with --graphs step"),
        (["--compile", "--compare", "fp8:layers,fp8:step"], "--compile with --graphs step"),
    ],
)
def test_options_no_run_uses_are_refused(args, message, capsys):
    assert message in cli_refusal(args, capsys)


def test_fp8_options_with_an_fp8_run_in_compare_are_taken():
    args = train.parse_args(["--device", "cpu", "--compare", "bf16,fp8", "--fp8-weights"])
    assert args.fp8_weights


def test_a_run_too_short_to_time_shows_no_nan(tmp_path, capsys):
    argv = [*FAST, "--steps", "1", "--no-graphs", "--precision", "bf16", "--out", str(tmp_path)]
    assert train.main(argv) == 0
    table = capsys.readouterr().out
    assert "bf16-eager" in table and "nan" not in table
