"""graphfp8.numerics on the gated MLPs: the report recomputes act(h) and dh as the fused GLU
kernels do, so every recorded amax equals the true one (fused kernels and the fallback)."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.numerics import FP8Stats
from tests.modules.common import H, T, build
from tests.modules.test_glu_mlp import _use_path

RECIPE = g8.DelayedScaling(amax_history_len=4)


@pytest.mark.parametrize("kind", ["SwiGLUMLP", "GeGLUMLP"])
@pytest.mark.parametrize("path", ["fused", "fallback"])
def test_recorded_amax_is_the_true_amax(device, kind, path, monkeypatch):
    _use_path(monkeypatch, path)
    m = build(kind, device=device)
    with FP8Stats(m) as stats:
        stats.enable(True)
        for mb in range(2):
            x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
            with g8.fp8_autocast(recipe=RECIPE):
                m(x, is_first_microbatch=mb == 0).float().square().sum().backward()
            stats.collect(0, mb)
        rows = stats.rows()
    assert len(rows) == 6 + 4, "microbatch 0: 2 inputs, 2 weights, 2 gradients; then no weights"
    # GeGLU on the GPU: CUDA's tanhf in the kernel, torch's in the recomputation.
    rtol = 1e-2 if kind == "GeGLUMLP" and device != "cpu" and path == "fused" else 0.0
    for r in rows:
        torch.testing.assert_close(r["recorded_amax"], r["true_amax"], rtol=rtol, atol=0.0,
                                   msg=f"{r['role']} {r.get('module')}")  # fmt: skip
