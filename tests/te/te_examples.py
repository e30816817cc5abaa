"""Runs TransformerEngine's own documentation examples (tests/te/examples/, copied unmodified from
NVIDIA/TransformerEngine; see its README.md) with `import graphfp8.te as te` for TE's import.

    python -m tests.te.te_examples [--device cuda] [--json out.json]

Every run changes exactly the lines below, each asserted to occur (a stale change fails):

- IMPORTS, on every device: TE's imports become graphfp8.te's. Nothing else changes on the GPU,
  except that the CUDA-graphs example's `get_cpu_offload_context(enabled=True, ...)` becomes
  `enabled=False` (graphfp8 has no activation offloading; with enabled=True graphfp8.te raises,
  which test_te_examples.py checks; with False TE returns the same null context).
- CPU (CI): `.cuda()` and `device="cuda"` become the CPU; in the timing helpers (speedometer)
  torch.cuda's timing events become a host timer and 50-100 timed iterations 3 (2 warmup); the
  layers are small (hidden 128, 4 heads, ffn 256, 64 tokens instead of hidden 4096, 32 heads,
  ffn 16384, 8192 / 16384 tokens; the graphs example's 1024 features 64): minutes of CPU time
  each otherwise. Dtypes, recipes, dropout and every call are TE's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent / "examples"

IMPORTS = [
    ("import transformer_engine.pytorch as te", "import graphfp8.te as te"),
    ("from transformer_engine.common.recipe import", "from graphfp8.te.recipe import"),
    ("from transformer_engine.common import recipe", "from graphfp8.te import recipe"),
    ("from transformer_engine.pytorch import", "from graphfp8.te import"),
]
_CUDA_CALL, _CUDA_DEVICE = (".cuda()", ".cpu()"), ('device="cuda"', 'device="cpu"')
_CPU_TIMER = [
    ("torch.cuda.Event(enable_timing=True)", "_HostTimer()"),
    ("torch.cuda.synchronize()", "torch.cpu.synchronize()"),
    ("import torch\n", "import torch\nfrom tests.te.te_examples import HostTimer as _HostTimer\n"),
]
_SIZES = [
    ("hidden_size = 4096", "hidden_size = 128"),
    ("sequence_length = 2048", "sequence_length = 32"),
    ("ffn_hidden_size = 16384", "ffn_hidden_size = 256"),
    ("num_attention_heads = 32", "num_attention_heads = 4"),
]


@dataclass
class Example:
    """One TE example: its main file (a notebook's code cells, or a script), the helper modules it
    imports, and the lines each device changes beyond IMPORTS ({file: [(old, new)]})."""

    name: str
    main: str
    helpers: tuple[str, ...] = ()
    everywhere: dict = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)


def _cpu(main: str, helper: str, sizes: list, iterations: list) -> dict:
    return {main: [_CUDA_CALL, *sizes], helper: _CPU_TIMER + iterations}


QUICKSTART = Example(
    "quickstart", "quickstart.ipynb", ("quickstart_utils.py",),
    cpu=_cpu("quickstart.ipynb", "quickstart_utils.py",
             _SIZES + [("batch_size = 4", "batch_size = 2")],
             [("timing_iters: int = 50", "timing_iters: int = 3"),
              ("warmup_iters: int = 50", "warmup_iters: int = 2")]),
)  # fmt: skip
GETTING_STARTED = Example(
    "getting_started", "getting_started_pytorch.py", ("getting_started_utils_pytorch.py",),
    cpu=_cpu("getting_started_pytorch.py", "getting_started_utils_pytorch.py",
             _SIZES + [("batch_size = 8", "batch_size = 2")],
             [("timing_iters: int = 100", "timing_iters: int = 3"),
              ("warmup_iters: int = 10", "warmup_iters: int = 2")]),
)  # fmt: skip
CUDA_GRAPHS = Example(
    "cuda_graphs", "pytorch_cuda_graphs_example.py",
    everywhere={"pytorch_cuda_graphs_example.py": [("enabled=True", "enabled=False")]},
    cpu={"pytorch_cuda_graphs_example.py": [_CUDA_CALL, _CUDA_DEVICE, ("1024", "64")]},
)  # fmt: skip
README = Example("readme", "readme_pytorch.py", cpu={"readme_pytorch.py": [_CUDA_DEVICE]})
ALL = (README, QUICKSTART, GETTING_STARTED, CUDA_GRAPHS)


class HostTimer:
    """torch.cuda.Event(enable_timing=True)'s record / elapsed_time on the host clock (CPU)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: HostTimer) -> float:
        return (end.t - self.t) * 1e3


def _source(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code") + "\n"


def _apply(text: str, changes: list, where: str) -> str:
    for old, new in changes:
        if old not in text:
            raise AssertionError(f"{where}: {old!r} is not in the example (stale change?)")
        text = text.replace(old, new)
    return text


def prepared(example: Example, device: str, into: Path) -> Path:
    """Writes the example's files with their changes for `device` into `into`; returns its main
    script."""
    for name in (example.main, *example.helpers):
        text = _source(EXAMPLES / name)
        text = _apply(text, [c for c in IMPORTS if c[0] in text], name)
        text = _apply(text, example.everywhere.get(name, []), name)
        if device == "cpu":
            text = _apply(text, example.cpu.get(name, []), name)
        (into / Path(name).with_suffix(".py").name).write_text(text)
    return into / Path(example.main).with_suffix(".py").name


def run(example: Example, device: str) -> dict:
    """Runs the example in this process (its helpers importable, its files written in a scratch
    directory); returns its globals."""
    with tempfile.TemporaryDirectory() as tmp, _in_dir(Path(tmp)):
        main = prepared(example, device, Path(tmp))
        namespace = {"__name__": "__main__", "__file__": str(main)}
        exec(compile(main.read_text(), str(main), "exec"), namespace)
    for helper in example.helpers:
        sys.modules.pop(Path(helper).stem, None)
    return namespace


@contextlib.contextmanager
def _in_dir(path: Path):
    """cwd and the front of sys.path: the examples import their helpers and write files."""
    cwd = os.getcwd()
    os.chdir(path)
    sys.path.insert(0, str(path))
    try:
        yield
    finally:
        sys.path.remove(str(path))
        os.chdir(cwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", help="write {example: seconds or error} here")
    args = parser.parse_args()
    results = {}
    for example in ALL:
        t0 = time.perf_counter()
        try:
            run(example, args.device)
            results[example.name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1)}
        except Exception as e:  # report every example, then fail
            results[example.name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(f"te example {example.name} on {args.device}: {results[example.name]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    sys.exit(0 if all(r["ok"] for r in results.values()) else 1)


if __name__ == "__main__":
    main()
