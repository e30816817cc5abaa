"""Device parametrization shared by the tests (CPU always, CUDA marked `cuda`) and small checks
several test files use."""

from __future__ import annotations

import pytest
import torch

from graphfp8.testing import assert_bitwise_equal

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


def assert_outputs_equal(got, want, names, what: str) -> None:
    """An op's outputs, named, bit for bit equal to the expected ones (None where not made)."""
    for g, w, name in zip(got, want, names, strict=True):
        assert (g is None) == (w is None), name
        if g is not None:
            assert_bitwise_equal(g, w, f"{name} of {what}")
