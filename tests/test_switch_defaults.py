"""A changed kernel-switch default needs the CUDA suite on a GPU first: the defaults in the code
must be the set recorded by the last `make gpu-check` whose CUDA suite passed with them
(scripts/switch_defaults.py)."""

from __future__ import annotations

import pytest

from graphfp8.ops import switches
from tests.test_layout import _load


@pytest.fixture(scope="module")
def script():
    return _load("switch_defaults")


def test_defaults_are_the_gpu_verified_set(script):
    """A new switch may land off without a GPU run (it changes no kernel a default run takes);
    every other difference from the verified set needs the CUDA suite."""
    now, verified = script.defaults(), script.verified()
    changed = {k: (verified.get(k), v) for k, v in now.items()
               if verified.get(k, False) != v}  # fmt: skip
    changed.update({k: (v, None) for k, v in verified.items() if k not in now})
    assert not changed, (
        f"kernel switch defaults differ from the GPU-verified set (verified, now): {changed}. "
        "Run the CUDA suite with the new defaults on a GPU (GPU_STEPS=tests make gpu-check) and "
        "copy the gpu_verified_switches.json it writes to tests/data/"
    )


def test_every_cpp_switch_is_known_to_python(script):
    cpp = {k for k in script.defaults() if k not in switches.ENV_DEFAULTS}
    assert cpp == set(switches.SWITCHES)


def test_env_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv("GRAPHFP8_CUDNN_RAGGED", raising=False)
    assert switches.env_switch("CUDNN_RAGGED") is False
    monkeypatch.setenv("GRAPHFP8_CUDNN_RAGGED", "1")
    assert switches.env_switch("CUDNN_RAGGED") is True
    monkeypatch.setenv("GRAPHFP8_CUDA_GLU", "0")
    assert switches.env_switch("CUDA_GLU") is False
