"""Resets graphfp8's global state and seeds before every test; the `device` fixture (CPU, and
CUDA marked `cuda`)."""

from __future__ import annotations

import gc

import pytest
import torch

import graphfp8
from tests.helpers import DEVICES


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread():
    """The tests run tiny tensors: one intra-op thread on the CPU, where waking a second thread
    costs more than the op (measured on the 2-core CI machine: the graph test matrix took ~9x the
    CPU time with torch's default of 2 threads while other jobs ran)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _frozen_imports():
    """The objects alive when the first test starts (torch's, transformers', the collected test
    modules') live for the whole session: frozen, the garbage collector's full passes skip them
    (measured: 12.6 s -> 7.2 s of collection in tests/graphs and tests/modules under load)."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts from a fresh process's graphfp8 state and the same seed."""
    graphfp8.reset_state()
    torch.manual_seed(1234)
    yield
    graphfp8.reset_state()


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Stops the data-parallel test ranks (tests/rank_pool.py) when the session ends."""
    yield
    from tests import rank_pool

    rank_pool.shutdown()
