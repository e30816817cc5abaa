"""training/floor.py's model FLOPs and physical floor, and training/speed.py's fields, against
hand-computed numbers (docs/benchmarking.md, "The floor")."""

from __future__ import annotations

import dataclasses

import pytest

from graphfp8.training.floor import (
    ACTIVATION_PARTS,
    H200,
    floor,
    gemm_parameters,
    memory_bytes,
    memory_parts,
    model_flops,
)
from graphfp8.training.model import PRESETS
from graphfp8.training.run import RunSpec
from graphfp8.training.speed import name_baseline, speed_fields, spread


def test_gemm_parameters_and_model_flops_of_llama_8b():
    """Llama-3-8B: per layer q/k/v 4096 x 6144, o 4096 x 4096, gate/up 4096 x 2 x 14336, down
    14336 x 4096; the head 128256 x 4096. Causal attention 6 x S x h per token and layer: the
    issue's (6 x GEMM parameters + 6 x S x h) x tokens, summed over the layers."""
    cfg = PRESETS["llama-8b"]
    per_layer = 4096 * 6144 + 4096 * 4096 + 4096 * 2 * 14336 + 14336 * 4096
    assert gemm_parameters(cfg) == {"blocks": 32 * per_layer, "head": 128256 * 4096}
    flops = model_flops(cfg, tokens=8192)
    assert flops["attention"] == 6 * 32 * 8192 * 4096 * 8192
    assert flops["total"] == pytest.approx(
        (6 * (32 * per_layer + 128256 * 4096) + 6 * 32 * 8192 * 4096) * 8192
    )
    # The embedding lookup and the norms are no GEMMs: 8.03e9 parameters, 7.50e9 in GEMMs.
    assert sum(gemm_parameters(cfg).values()) == 8_030_261_248 - 128256 * 4096 - 65 * 4096


def test_floor_parts_at_the_h200_ceilings():
    cfg = dataclasses.replace(PRESETS["llama-1b"], layers=4)
    tokens = 2 * 4096 * 2
    flops = model_flops(cfg, tokens)
    fp8, bf16 = floor(cfg, "fp8", tokens), floor(cfg, "bf16", tokens)
    assert fp8["blocks_gemm"] == pytest.approx(flops["blocks"] / 1469e12)
    assert bf16["blocks_gemm"] == pytest.approx(flops["blocks"] / 799e12)
    assert fp8["head_gemm"] == bf16["head_gemm"] == pytest.approx(flops["head"] / 799e12)
    assert fp8["attention"] == pytest.approx(flops["attention"] / 550e12)
    assert fp8["memory"] == pytest.approx(memory_bytes(cfg, "fp8", tokens)["total"] / 4.3e12)
    parts = ("blocks_gemm", "head_gemm", "attention", "memory")
    assert fp8["total"] == pytest.approx(sum(fp8[k] for k in parts))
    assert fp8["total"] < bf16["total"]
    assert fp8["ceilings"] == H200.to_dict()
    # The loss reads the bf16 logits and writes their gradient: 4 x vocab bytes per token.
    assert memory_bytes(cfg, "bf16", tokens)["loss"] == 4 * 128256 * tokens


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_memory_parts_add_up_to_memory_bytes(precision):
    """The parts benchmarks/floor_gap.py measures each kernel family against: the same bytes as
    memory_bytes; SwiGLU's backward at Llama-3.2-1B reads dy (2 B x F) and the saved gate and up
    (4 B x F) and writes dgate, dup in FP8, both layouts (4 x F) or in bf16 (4 x F)."""
    cfg = dataclasses.replace(PRESETS["llama-1b"], layers=4)
    tokens = 2 * 4096 * 2
    parts, total = memory_parts(cfg, precision, tokens), memory_bytes(cfg, precision, tokens)
    assert sum(parts[k] for k in ACTIVATION_PARTS) == total["activations"]
    assert parts["optimizer"] + parts["weight_casts"] == total["optimizer"]
    assert sum(parts.values()) == total["total"]
    assert parts["act_bwd"] == 4 * 10 * 8192 * tokens
    assert parts["weight_casts"] == (4 * gemm_parameters(cfg)["blocks"] if precision == "fp8"
                                     else 0)  # fmt: skip


def test_speed_fields_and_baseline():
    cfg = PRESETS["llama-100m"]
    spec = RunSpec("llama-100m", cfg, "fp8", "layers", microbatches=4, device="cuda")
    tokens_per_step = 4 * 8 * 1024
    f = speed_fields(spec, 700_000.0, [690_000.0, 700_000.0, 720_000.0])
    assert f["tokens_per_s_spread"] == {"min": 690_000.0, "median": 700_000.0,
                                        "max": 720_000.0, "n": 3}  # fmt: skip
    assert f["model_tflops"] == pytest.approx(model_flops(cfg, 700_000)["total"] / 1e12)
    assert f["floor_fraction"] == pytest.approx(f["floor"]["total"] * 700_000 / tokens_per_step)
    assert f["peer"] == {"graphed": "blocks", "compiled": "no", "attention": "cuDNN bf16"}
    assert spread([]) is None
    runs = [
        {"name": "fp8-graphs", "graphs": "layers", "tokens_per_s": 3.0},
        {"name": "bf16-torch-compile", "graphs": "compile", "tokens_per_s": 2.0},
    ]
    assert name_baseline(runs) == "bf16-torch-compile"
    assert [r["speedup"] for r in runs] == [1.5, 1.0]
