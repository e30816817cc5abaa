"""The main job (python -m graphfp8.demo) runs, and its graphed run equals its eager run."""

from __future__ import annotations

import pytest

from graphfp8 import demo


def test_demo_runs_and_graphed_equals_eager(capsys):
    demo.main(["--device", "cpu", "--steps", "3", "--microbatches", "2", "--hidden", "32",
               "--tokens", "32", "--layers", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "fp8 graphed == fp8 eager, bit for bit (losses and weights): True" in out


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        demo.main(["--device", "cpu", "--hidden", "40"])
    with pytest.raises(SystemExit):
        demo.main(["--device", "cpu", "--steps", "0"])
