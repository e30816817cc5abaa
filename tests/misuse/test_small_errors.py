"""Small misuse cases of issue 25 and of the round in notes/MISUSE.md: Float8Tensor.tolist()/numpy()
(torch refused them for a tensor subclass, naming no alternative), a build that says what it
builds before a silent minute, memory_report's arguments, a recipe object in a checkpoint."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8.primary import quantize_weight
from graphfp8.memory import memory_report
from tests.modules.common import extra_state

ROOT = Path(__file__).resolve().parents[2]


def test_float8_tensor_tolist_and_numpy_give_the_dequantized_values():
    t = quantize_weight(torch.randn(3, 4))
    assert t.tolist() == t.dequantize().tolist()
    assert (t.numpy() == t.dequantize().numpy()).all()
    b = quantize_weight(torch.randn(3, 4, dtype=torch.bfloat16))
    assert b.tolist() == b.dequantize().tolist()
    with pytest.raises(TypeError, match=r"dequantize\(torch.float32\).numpy\(\)"):
        b.numpy()


def test_the_build_says_what_it_builds(monkeypatch, capsys):
    # `python setup.py build_ext --help`, run in this process (torch is imported already)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["setup.py", "build_ext", "--help"])
    code = 0
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code or 0
    err = capsys.readouterr().err
    assert code == 0, err
    assert "graphfp8: building the extension graphfp8._C from" in err
    makefile = (ROOT / "Makefile").read_text()
    assert "min of CPU time" in makefile and "scripts/build_progress.py" in makefile


def test_the_build_progress_filter(tmp_path):
    """make install pipes pip's verbose build through scripts/build_progress.py: one line per
    compiled file, and pip's failure (no success line) is the filter's exit status."""
    ninja = (
        "  [2/16] c++ -MMD -MF /tmp/b/csrc/cpu/rope.o.d -O3 -c -c /src/csrc/cpu/rope.cpp "
        "-o /tmp/b/csrc/cpu/rope.o\n"
    )
    script = [sys.executable, str(ROOT / "scripts" / "build_progress.py")]
    ok = subprocess.run(script, input=ninja + "Successfully installed graphfp8-0.1.0\n",
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ok.returncode == 0
    assert "[2/16] compiling csrc/cpu/rope.cpp" in ok.stdout
    failed = subprocess.run(script, input=ninja + "error: some failure\n", capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert failed.returncode == 1 and "error: some failure" in failed.stdout


def test_memory_report_refuses_what_it_cannot_count():
    m = g8.Linear(32, 32)
    with pytest.raises(TypeError, match="model must be an nn.Module, got Tensor"):
        memory_report(torch.randn(3))
    with pytest.raises(TypeError, match=r"graphed= takes what make_graphed_callables returned"):
        memory_report(m, graphed=[m])  # not graphed: it was silently left out


def test_a_checkpoint_may_hold_a_recipe_object():
    recipe = g8.DelayedScaling(amax_history_len=4)
    m = g8.Linear(32, 32)
    with g8.fp8_autocast(recipe=recipe):
        m(torch.randn(16, 32))
    state = m.state_dict()
    state["_extra_state"] = extra_state(state["_extra_state"])  # the dict form, a recipe object
    assert state["_extra_state"]["recipe"] == recipe
    other = g8.Linear(32, 32)
    other.load_state_dict(state)
    assert other.fp8_meta.recipe == recipe
