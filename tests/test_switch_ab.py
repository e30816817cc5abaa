"""scripts/switch_ab.py, the off / on table of a kernel switch over graphfp8-train runs: ratios
per repeat, their median and spread, and the final-loss verdict (a switch must change no bit)."""

from __future__ import annotations

import json

import pytest

from tests.test_layout import _load


@pytest.fixture(scope="module")
def script():
    return _load("switch_ab")


def _runs(tmp_path, side: str, speeds: list[float], losses: list[float]) -> list[str]:
    dirs = []
    for i, (tps, loss) in enumerate(zip(speeds, losses, strict=True)):
        d = tmp_path / f"{side}{i}"
        d.mkdir()
        run = {"name": "fp8-step", "tokens_per_s": tps, "final_loss": loss}
        (d / "summary.json").write_text(json.dumps({"runs": [run]}))
        dirs.append(str(d))
    return dirs


def test_ratios_median_and_same_loss(script, tmp_path, capsys):
    off = _runs(tmp_path, "off", [100.0, 200.0, 400.0], [3.25] * 3)
    on = _runs(tmp_path, "on", [110.0, 190.0, 420.0], [3.25] * 3)
    assert script.main(["--switch", "S", "--off", *off, "--on", *on]) == 0
    text = capsys.readouterr().out
    assert "| 1 | 100 | 110 | 1.1000 |" in text
    assert "on / off median 1.0500 (min 0.9500, max 1.1000) over 3 repeats" in text
    assert "final loss the same bit for bit in every run: yes" in text


def test_a_changed_loss_fails(script, tmp_path, capsys):
    off = _runs(tmp_path, "off", [100.0], [3.25])
    on = _runs(tmp_path, "on", [100.0], [3.2500001])
    assert script.main(["--switch", "S", "--off", *off, "--on", *on]) == 1
    assert "NO (" in capsys.readouterr().out


def test_unequal_repeats_are_refused(script, tmp_path):
    off = _runs(tmp_path, "off", [100.0, 100.0], [3.0, 3.0])
    on = _runs(tmp_path, "on", [100.0], [3.0])
    with pytest.raises(SystemExit, match="as many --on runs"):
        script.main(["--switch", "S", "--off", *off, "--on", *on])
