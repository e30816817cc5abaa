"""The default of every kernel switch, and the set the CUDA suite last passed with on a GPU.

A switch's default decides which kernels every run takes, so a changed default needs the CUDA
suite on a GPU before it lands: tests/test_switch_defaults.py fails (on the CPU, in CI) while
the defaults in the code differ from tests/data/gpu_verified_switches.json, and `make gpu-check`
(scripts/gpu_check.sh, step tests) writes that file's new contents when the CUDA suite passed
with the defaults in force.

    python scripts/switch_defaults.py                      # the defaults, as JSON
    python scripts/switch_defaults.py --record PATH --note "H200, 2207 passed"
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "ops" / "switches.h"
RECORD = ROOT / "tests" / "data" / "gpu_verified_switches.json"
_ENTRY = re.compile(r'\{"([A-Z0-9_]+)",\s*\{(true|false)\}\}')


def defaults() -> dict[str, bool]:
    """Every switch's default as the code sets it (independent of the environment): the C++
    table of csrc/ops/switches.h and graphfp8.ops.switches.ENV_DEFAULTS."""
    from graphfp8.ops.switches import ENV_DEFAULTS

    table = dict((name, on == "true") for name, on in _ENTRY.findall(HEADER.read_text()))
    if not table:
        raise RuntimeError(f"no switch table found in {HEADER}")
    return dict(sorted({**table, **ENV_DEFAULTS}.items()))


def verified() -> dict[str, bool]:
    """The switch set of the last CUDA suite that passed on a GPU (RECORD)."""
    return json.loads(RECORD.read_text())["switches"]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record", type=Path, help="write the defaults as a verified set to PATH")
    p.add_argument("--note", default="", help="what ran (GPU, passed count)")
    args = p.parse_args()
    now = defaults()
    if args.record is None:
        print(json.dumps(now))
        return 0
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    record = {"switches": now, "date": stamp, "commit": _commit(), "note": args.note}
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
