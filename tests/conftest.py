"""Seeds every test and provides the `device` fixture (CPU, and CUDA marked `cuda`)."""

from __future__ import annotations

import pytest
import torch

import graphfp8  # noqa: F401  (registers torch.ops.graphfp8)
from tests.helpers import DEVICES


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
