"""Graph tests run tiny tensors: one intra-op thread on the CPU, where waking a second thread
costs more than the op (measured on the 2-core CI machine: the test matrix took ~9x the CPU
time with torch's default of 2 threads while other jobs ran)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
