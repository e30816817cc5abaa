"""Device parametrization shared by the tests: CPU always, CUDA marked `cuda`."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

CUDA_PARAM = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
)
DEVICES = ["cpu", CUDA_PARAM]

HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fills t in place with random bytes (never zeros), so unwritten elements show."""
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(1, 255, raw.shape, dtype=torch.uint8))
    return t
