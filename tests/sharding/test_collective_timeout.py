"""graphfp8-train --collective-timeout-s: how long a collective waits for a hung rank before every
rank fails, handed to init_process_group's timeout (600 s unless given); not a positive whole
number is a one-line usage error."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from graphfp8.training import cli as train


class _Joined(Exception):
    """Raised by the stand-in init_process_group once it has seen its arguments."""


@pytest.mark.parametrize(("option", "seconds"), [([], 600), (["--collective-timeout-s", "7"], 7)])
def test_collective_timeout_reaches_init_process_group(monkeypatch, option, seconds):
    seen = {}

    def init_process_group(**kwargs):
        seen.update(kwargs)
        raise _Joined

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(_Joined):
        train.main(["--device", "cpu", "--ddp", *option])
    assert seen["timeout"] == timedelta(seconds=seconds)
    assert seen["backend"] == "gloo"


def test_collective_timeout_must_be_positive(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", "--ddp", "--collective-timeout-s", "0"])
    assert "--collective-timeout-s: must be >= 1" in capsys.readouterr().err
