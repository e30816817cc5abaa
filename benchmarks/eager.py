"""Eager host-overhead benchmark: CPU time to enqueue forward and forward + backward of
graphfp8.Linear (FP8, cached weight) against nn.Linear bf16, torchao Float8Linear and, where it
imports, TransformerEngine's te.Linear (FP8, cached weight)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import graphfp8 as g8
from benchmarks.common import environment, print_table, time_host
from benchmarks.peers import RECIPE, torchao_available
from benchmarks.te_peers import te_linear_peer, try_build


def _peers(n: int, tokens: int, device) -> dict:
    torch.manual_seed(0)
    ref = nn.Linear(n, n, dtype=torch.bfloat16, device=device)
    g = g8.Linear(n, n, params_dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        g.weight.copy_(ref.weight)
        g.bias.copy_(ref.bias)
    x = torch.randn(tokens, n, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(tokens, n, dtype=torch.bfloat16, device=device)
    with g8.fp8_autocast(recipe=RECIPE):
        g(x, is_first_microbatch=True)  # fills the weight cache

    def g8_fwd():
        with g8.fp8_autocast(recipe=RECIPE):
            return g(x, is_first_microbatch=False)

    peers = {"nn.Linear bf16": (lambda: ref(x)), "graphfp8.Linear fp8": g8_fwd}
    if torchao_available():
        from torchao.float8 import convert_to_float8_training

        ao = convert_to_float8_training(nn.Sequential(copy.deepcopy(ref)))
        peers["torchao Float8Linear"] = lambda: ao(x)
    if torch.device(device).type == "cuda":
        te_fwd = try_build("TE Linear fp8", lambda: te_linear_peer(ref, x), {})
        if te_fwd is not None:
            peers["TE Linear fp8"] = te_fwd
    return {name: (fwd, dy) for name, fwd in peers.items()}


def run(device, quick: bool = False) -> dict:
    rows, results = [], []
    sizes = [1024] if quick else [1024, 4096]
    for n in sizes:
        tokens = n
        peers = _peers(n, tokens, device)
        base = {}
        for name, (fwd, dy) in peers.items():
            fwd_ms = time_host(fwd, device, iters=50, repeats=5)
            both_ms = time_host(lambda fwd=fwd, dy=dy: fwd().backward(dy), device, iters=50,
                                repeats=5)  # fmt: skip
            base.setdefault("fwd", fwd_ms)
            base.setdefault("both", both_ms)
            results.append(dict(size=n, tokens=tokens, peer=name, fwd_host_ms=fwd_ms,
                                fwd_bwd_host_ms=both_ms))  # fmt: skip
            rows.append([f"{n}x{n}, T={tokens}", name, fwd_ms * 1e3, both_ms * 1e3,
                         fwd_ms / base["fwd"], both_ms / base["both"]])  # fmt: skip
    text = print_table(
        f"host time to enqueue one call, {device} (ratio to nn.Linear bf16)",
        ["layer", "peer", "fwd us", "fwd+bwd us", "fwd ratio", "fwd+bwd ratio"],
        rows,
    )
    return {"env": environment(device), "rows": results, "table": text}
