"""Every python block of README.md runs as written: in order, as one script, on the CPU (the
blocks pick the GPU when there is one), in a scratch directory (they write files)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def test_the_readme_runs_as_written(tmp_path, monkeypatch):
    pytest.importorskip("transformers")  # the Hugging Face block
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 7
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        code = compile(block, f"README.md python block {i + 1}", "exec")
        exec(code, namespace)
    # What the blocks say they do, done: training ran in FP8 and wrote what it says.
    assert math.isfinite(float(namespace["loss"]))
    for name in ("fp8_stats.csv", "hf_state.pt", "llama-fp8/model.safetensors"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert type(namespace["served"]).__name__ == "LlamaForCausalLM"
    assert namespace["layer"].fp8_meta is not None and namespace["te_layer"].training
    torch.compiler.reset()
