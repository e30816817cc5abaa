"""Every python block of README.md and of the docs pages that continue its first example runs as
written: in order, as one script, on the CPU (the blocks pick the GPU when there is one), in a
scratch directory (they write files)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The README, then the docs pages whose blocks use its names, in the order the README lists them.
PAGES = ("README.md", "docs/usage.md", "docs/integrations.md", "docs/training.md",
         "docs/multi-gpu.md")  # fmt: skip
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def test_the_readme_runs_as_written(tmp_path, monkeypatch):
    pytest.importorskip("transformers")  # the Hugging Face block
    blocks = [(page, i, block) for page in PAGES
              for i, block in enumerate(python_blocks((ROOT / page).read_text()))]  # fmt: skip
    assert len(blocks) >= 7 and {page for page, _, _ in blocks} == set(PAGES)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for page, i, block in blocks:
        code = compile(block, f"{page} python block {i + 1}", "exec")
        exec(code, namespace)
    # What the blocks say they do, done: training ran in FP8 and wrote what it says.
    assert math.isfinite(float(namespace["loss"]))
    for name in ("fp8_stats.csv", "hf_state.pt", "llama-fp8/model.safetensors"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert type(namespace["served"]).__name__ == "LlamaForCausalLM"
    assert namespace["layer"].fp8_meta is not None and namespace["te_layer"].training
    torch.compiler.reset()
