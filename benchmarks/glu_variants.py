"""The per-tensor SwiGLU kernels with their kernel switches off and on in one run (issue 41, cut
3; notes/PERF.md, "Issue 41: the SwiGLU kernels"): glu_cast_transpose and
dglu_cast_transpose_dbias with GLU_V2 off / on, then GLU_V2_DIV off / on with GLU_V2 on, at one
Llama-3.2-1B MLP microbatch (4096 tokens), Llama 1B's B2 x S4096 and Llama 3 8B's B1 x S8192,
against a bf16 copy timed in the same run (benchmarks/variants.py's rows).

    python -m benchmarks glu-v2 [--quick] [--json PATH]
"""

from __future__ import annotations

import torch

from benchmarks.common import environment
from benchmarks.kernels import _rotating
from benchmarks.variants import _copy_gbs, _switch_row, switch_table
from graphfp8 import ops
from graphfp8.ops.switches import kernel_switch

__all__ = ["GLU_SHAPES", "run"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (tokens, F): the profile_blockwise microbatch, Llama 1B's and Llama 3 8B's rows of `speed`
GLU_SHAPES = [(4096, 8192), (8192, 8192), (8192, 14336)]


def _glu_rows(m: int, f: int, device) -> list[dict]:
    """glu_cast_transpose (E4M3, 6 B per element of a: h read, both FP8 layouts written) and
    dglu_cast_transpose_dbias (E5M2 without dbias as the MLP runs it, 10 B) with GLU_V2 off
    and on, then GLU_V2_DIV off and on with GLU_V2 on, against a copy of h (m, 2F)."""
    sets = _rotating(lambda: (torch.randn(m, 2 * f, device=device, dtype=torch.bfloat16),
                              torch.randn(m, f, device=device, dtype=torch.bfloat16)),
                     10 * m * f, device)  # fmt: skip
    copy_gbs = _copy_gbs(sets, device)
    one, amax = torch.ones(1, device=device), torch.zeros(1, device=device)
    fwd = lambda h, da: ops.glu_cast_transpose(h, "swiglu", one, amax, E4M3)  # noqa: E731
    bwd = lambda h, da: ops.dglu_cast_transpose_dbias(  # noqa: E731
        da, h, "swiglu", one, amax, E5M2, dbias=False)  # fmt: skip
    cases = (("swiglu fwd", 6, fwd), ("swiglu bwd", 10, bwd))
    rows = [_switch_row("GLU_V2", op, (m, f), n, fn, sets, copy_gbs, device) for op, n, fn in cases]
    with kernel_switch("GLU_V2", True):
        rows += [_switch_row("GLU_V2_DIV", op, (m, f), n, fn, sets, copy_gbs, device)
                 for op, n, fn in cases]  # fmt: skip
    return rows


def run(device, quick: bool = False) -> dict:
    """The rows at GLU_SHAPES (quick: one tiny shape, a CPU smoke run: the switches act on CUDA
    only), printed as a table."""
    rows = [r for m, f in ([(128, 256)] if quick else GLU_SHAPES) for r in _glu_rows(m, f, device)]
    text = switch_table(
        f"SwiGLU kernels: switch off / on, bf16 (same run; ratios to a bf16 copy), {device}", rows
    )
    return {"env": environment(device), "switches": rows, "table": text}
