"""What the training-app tests share: graphfp8-train's argument refusals."""

from __future__ import annotations

import pytest

from graphfp8.training import cli


def cli_refusal(args: list[str], capsys) -> str:
    """stderr of graphfp8-train's parse_args(["--device", "cpu", *args]), which must refuse
    them (argparse's SystemExit)."""
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", *args])
    return capsys.readouterr().err
