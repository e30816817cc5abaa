"""Small misuse cases of issue 25: Float8Tensor.tolist()/numpy() (torch refused them for a tensor
subclass, naming no alternative) and a build that says what it builds before a silent minute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphfp8.fp8.primary import quantize_weight

ROOT = Path(__file__).resolve().parents[2]


def test_float8_tensor_tolist_and_numpy_give_the_dequantized_values():
    t = quantize_weight(torch.randn(3, 4))
    assert t.tolist() == t.dequantize().tolist()
    assert (t.numpy() == t.dequantize().numpy()).all()
    b = quantize_weight(torch.randn(3, 4, dtype=torch.bfloat16))
    assert b.tolist() == b.dequantize().tolist()
    with pytest.raises(TypeError, match=r"dequantize\(torch.float32\).numpy\(\)"):
        b.numpy()


def test_the_build_says_what_it_builds():
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "graphfp8: building the extension graphfp8._C from" in done.stderr
    assert "a minute or more" in (ROOT / "Makefile").read_text()
