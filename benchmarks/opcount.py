"""Kernels per TransformerLayer per microbatch, counted from what a graph captures (issue 22: at
most half of today's ~54): one graphed TransformerLayer (weight caching on), its forward and
backward graphs' dispatcher ops, as the CPU replay tape records them (graphs/tape.py), so it runs
anywhere; views and allocations launch nothing and are left out, and the graphfp8 ops that launch
two CUDA kernels (a tile kernel and its dbias reduction, the norm and its transpose, the norm
backward and its parameter-gradient reduction) count twice. On a GPU the graphs' own kernel nodes
are counted too (the real number: cuBLAS and attention may launch more than one). Recipes:
delayed scaling, current scaling on the three-launch path and on the fused path
(graphfp8/fp8/current.py), and bf16."""

from __future__ import annotations

import collections
import contextlib

import torch

import graphfp8 as g8
from benchmarks.common import environment, print_table
from graphfp8.fp8 import current
from graphfp8.ops.switches import switch_on

# Dispatcher ops that launch no kernel (views, allocation, metadata).
NO_KERNEL = {"aten::detach", "aten::empty", "aten::empty_like", "aten::empty_strided",
             "aten::view", "aten::_unsafe_view", "aten::t", "aten::transpose", "aten::unbind",
             "aten::reshape", "aten::as_strided", "aten::expand", "aten::permute", "aten::select",
             "aten::slice", "aten::split", "aten::split_with_sizes", "aten::unsqueeze",
             "aten::squeeze", "aten::alias", "aten::lift_fresh", "aten::set_"}  # fmt: skip
# graphfp8 ops that launch two CUDA kernels.
TWO_KERNELS = {"graphfp8::cast_transpose_dbias", "graphfp8::dgelu_cast_transpose_dbias",
               "graphfp8::layernorm_bwd", "graphfp8::rmsnorm_bwd"}  # fmt: skip
# The norms launch their transpose pass only when asked for the transposed layout: always in a
# TransformerLayer's real casts, never in the three-launch path's norm amax passes, which this
# count (names only) therefore takes for 2 kernels where they launch 1.
NORM_WITH_TRANSPOSE = {"graphfp8::layernorm_fp8", "graphfp8::rmsnorm_fp8"}


# The fused dbias ops, one kernel under the kernel switch DBIAS_IN_KERNEL.
DBIAS_OPS = {"graphfp8::cast_transpose_dbias", "graphfp8::dgelu_cast_transpose_dbias"}
# The norm backwards, one kernel under NORM_BWD_STAGED + NORM_BWD_PARAM_IN_KERNEL (where the staged
# kernel takes the row: vectorised, hidden <= 4096 in 16 bits, as in every preset).
NORM_BWD_OPS = {"graphfp8::layernorm_bwd", "graphfp8::rmsnorm_bwd"}
NORM_BWD_ONE_KERNEL = ("NORM_BWD_BATCHED", "NORM_BWD_STAGED", "NORM_BWD_PARAM_IN_KERNEL")


def kernels(names: list[str]) -> collections.Counter:
    """{op: CUDA kernels} of a captured op list, under the kernel switches now in force."""
    two = TWO_KERNELS | NORM_WITH_TRANSPOSE
    if switch_on("DBIAS_IN_KERNEL"):
        two = two - DBIAS_OPS
    if switch_on("NORM_FWD_TRANSPOSE"):  # the band kernel: hidden <= 3072, as every preset
        two = two - NORM_WITH_TRANSPOSE  # but llama-8b's (csrc/cuda/norm_fwd.cu)
    if all(switch_on(s) for s in NORM_BWD_ONE_KERNEL):
        two = two - NORM_BWD_OPS
    out: collections.Counter = collections.Counter()
    for name in names:
        if name in NO_KERNEL:
            continue
        out[name] += 2 if name in two else 1
    return out


@contextlib.contextmanager
def _current_path(fused: bool):
    before = (current.FUSED_ON_CPU, current.FUSED_ON_CUDA)
    current.FUSED_ON_CPU = current.FUSED_ON_CUDA = fused
    try:
        yield
    finally:
        current.FUSED_ON_CPU, current.FUSED_ON_CUDA = before


def count_layer(recipe, fused: bool, device, hidden: int, heads: int, seq: int) -> dict:
    """Kernels of one graphed TransformerLayer microbatch (forward, backward, by op)."""
    torch.manual_seed(0)
    layer = g8.TransformerLayer(hidden, heads, 4 * hidden, max_seq_len=seq,
                                params_dtype=torch.bfloat16, device=device)  # fmt: skip
    x = torch.randn(2, seq, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    with _current_path(fused):
        graphed = g8.make_graphed_callables(layer, (x,), fp8_enabled=recipe is not None,
                                            fp8_recipe=recipe,
                                            fp8_weight_caching=recipe is not None)  # fmt: skip
    ops = graphed.captured_ops()
    fwd, bwd = kernels(ops["forward"]), kernels(ops["backward"])
    row = {"forward": sum(fwd.values()), "backward": sum(bwd.values()),
           "total": sum(fwd.values()) + sum(bwd.values()), "by_op": dict(fwd + bwd)}  # fmt: skip
    if torch.device(device).type == "cuda":  # the graphs' own kernel nodes: the real count
        nodes = graphed.captured_kernels()
        row["cuda_graph_kernels"] = len(nodes["forward"]) + len(nodes["backward"])
    return row


def run(device, quick: bool = False) -> dict:
    """The counts; on the CPU (the replay tape) at any size, on CUDA from the same capture."""
    if torch.device(device).type == "cuda" and not quick:
        hidden, heads, seq = 1024, 8, 2048
    else:
        hidden, heads, seq = 64, 2, 32
    recipes = {
        "fp8 delayed": (g8.DelayedScaling(), False),
        "fp8 current, three launches": (g8.Float8CurrentScaling(), False),
        "fp8 current, fused": (g8.Float8CurrentScaling(), True),
        "bf16": (None, False),
    }
    rows = {name: count_layer(r, f, device, hidden, heads, seq) for name, (r, f) in recipes.items()}
    names = sorted({op for row in rows.values() for op in row["by_op"]})
    on_gpu = all("cuda_graph_kernels" in r for r in rows.values())
    text = print_table(
        f"CUDA kernels per TransformerLayer per microbatch, from the captured ops (graphed, "
        f"weight caching), h={hidden}",
        ["recipe", "forward", "backward", "total", *(["CUDA graph kernel nodes"] * on_gpu)],
        [[name, r["forward"], r["backward"], r["total"], *([r.get("cuda_graph_kernels")] * on_gpu)]
         for name, r in rows.items()],
    )  # fmt: skip
    text += print_table(
        "kernels by op (forward + backward)",
        ["op", *rows],
        [[op, *[r["by_op"].get(op, 0) for r in rows.values()]] for op in names],
    )
    return {"env": environment(device), "hidden": hidden, "layers": rows, "table": text}
