"""Diagnoses the CUDA-only segfault seen when graphfp8.rope_qkv's C++ checks reject a bad input
(H200, 2026-11-29): runs each bad call in its own subprocess and prints how it ended.

    python scripts/diag_rope_crash.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile

CASES = {
    "2-D input alone": "q[0], c, s, 2",
    "bad num_heads": "q, c, s, 5",
    "short cos": "q, c[:4], s, 2",
    "int32 then 2-D": None,
    "control: fp8_transpose of a 3-D input": "transpose",
}

PRELUDE = """
import torch, graphfp8
from graphfp8.modules.transformer import rope_tables
q = torch.randn(2, 16, 48, device="cuda", dtype=torch.bfloat16)
c, s = rope_tables(19, 8, 500.0, torch.float32, "cuda")
op = torch.ops.graphfp8.rope_qkv
def call(qkv, cos, sin, heads):
    try:
        op(qkv, cos, sin, heads, False, torch.empty_like(qkv))
        print("no error")
    except RuntimeError as e:
        print("RuntimeError:", str(e).splitlines()[0][:120])
"""


TRANSPOSE = """
x = torch.zeros(2, 4, 4, device="cuda").to(torch.float8_e4m3fn)
try:
    torch.ops.graphfp8.fp8_transpose(x, torch.empty_like(x), None)
except RuntimeError as e:
    print("RuntimeError:", str(e).splitlines()[0][:120])
"""


def _body(args) -> str:
    if args is None:
        return "call(q.to(torch.int32), c, s, 2)\ncall(q[0], c, s, 2)"
    return TRANSPOSE if args == "transpose" else f"call({args})"


def main() -> int:
    for name, args in CASES.items():
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(PRELUDE + _body(args))
        done = subprocess.run([sys.executable, "-X", "faulthandler", f.name],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        print(f"== {name}: exit {done.returncode}")
        print(done.stdout.strip())
        if done.returncode != 0:
            print("\n".join(done.stderr.strip().splitlines()[-6:]))
            if shutil.which("gdb"):
                gdb = subprocess.run(["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 30", "--args",
                                      sys.executable, f.name], capture_output=True, text=True,
                                     timeout=300)  # fmt: skip
                print("\n".join(gdb.stdout.strip().splitlines()[-40:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
