"""Checks the size rules of docs/architecture.md: Python functions of at most ~60 lines (their
docstrings not counted) and files
of at most ~400 lines (C++/CUDA sources included), unless the file's opening comment or
docstring says why it is longer ("Longer than ..."). Exit status 1 lists the offenders.

    python scripts/check_sizes.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
REASON = "Longer than"  # how a file's opening text says why it is long


def _sources() -> list[Path]:
    py = [p for d in ("graphfp8", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    py += sorted((ROOT / "scripts").glob("*.py"))
    native = [p for ext in ("*.cpp", "*.cu", "*.cuh", "*.h") for p in (ROOT / "csrc").rglob(ext)]
    return py + sorted(native)


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant
            ):
                length -= first.end_lineno - first.lineno + 1
            if length > MAX_FUNCTION_LINES:
                rel = path.relative_to(ROOT)
                out.append(f"{rel}:{node.lineno} {node.name}() has {length} lines")
    return out


def long_file(path: Path) -> str | None:
    lines = path.read_text().splitlines()
    if len(lines) <= MAX_FILE_LINES:
        return None
    head = "\n".join(lines[:15])
    if REASON in head:
        return None
    rel = path.relative_to(ROOT)
    return f"{rel} has {len(lines)} lines and no '{REASON} ...' reason at its top"


def problems() -> list[str]:
    out = []
    for path in _sources():
        if path.suffix == ".py":
            out += long_functions(path)
        msg = long_file(path)
        if msg:
            out.append(msg)
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    print(f"{len(found)} size problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
