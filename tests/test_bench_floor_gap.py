"""benchmarks/floor_gap.py on the kept H200 speed record (profiles/h200-2026-12-01-s6): every
kernel in one group, the groups' excesses and the idle time adding up to wall - floor, and the
kernels of issue 41's families where notes/PERF.md counts them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.floor_gap import GROUPS, KEPT, gap_rows, gap_table, group_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def record():
    return json.loads((ROOT / KEPT).read_text())


@pytest.mark.parametrize("peer", ["fp8-graphs", "bf16-torch-compile"])
def test_groups_add_up_to_the_wall_and_the_floor(record, peer):
    for row in record["rows"]:
        p = row["peers"][peer]
        rows = gap_rows(row, peer)
        assert [r["group"] for r in rows[:-2]] == list(GROUPS)
        groups, idle, total = rows[:-2], rows[-2], rows[-1]
        kernels = p["kernel_table"]["kernel_ms"]
        assert sum(r["ms"] for r in groups) == pytest.approx(kernels)
        assert idle["ms"] == pytest.approx(p["ms_per_step"] - kernels)
        assert sum(r["floor_ms"] for r in groups) == pytest.approx(p["floor_ms"]["total"])
        assert sum(r["excess_ms"] for r in rows[:-1]) == pytest.approx(total["excess_ms"])
        assert sum(r["share"] for r in rows[:-1]) == pytest.approx(1.0)
        launches = sum(k["launches"] for k in p["kernel_table"]["kernels"])
        assert sum(r["launches"] for r in groups) == pytest.approx(launches)


def test_issue_41_families(record):
    """The FP8 kernels of a Llama block in their families; the layer graphs' -0.0 fill and
    adds in the gradient accumulation group, AdamW and the clip in the optimizer's."""
    row = record["rows"][1]  # llama-1b, 4 layers
    names = {
        k["name"]: k["category"] for k in row["peers"]["fp8-graphs"]["kernel_table"]["kernels"]
    }
    got = {}
    for name, cat in names.items():
        got.setdefault(group_of(name, cat), []).append(name)

    def has(group, part):
        return any(part in n for n in got.get(group, []))

    assert has("activation bwd", "glu_bwd_kernel")
    assert has("activation fwd (SwiGLU)", "glu_fwd_kernel")
    assert has("norm bwd (+ parameter grads)", "norm_bwd_batched_kernel")
    assert has("norm fwd (+ residual add, FP8 transpose pass)", "norm_fwd_kernel")
    assert has("casts / cast-transposes", "cast_transpose_kernel")
    assert has("RoPE fwd + bwd", "rope_fp8_bwd_kernel")
    assert has("grad accumulation (-0.0 fill, adds)", "ZeroFunctor")
    assert has("grad accumulation (-0.0 fill, adds)", "std::negate")
    assert has("optimizer (AdamW, clip)", "FusedAdamMathFunctor")
    assert has("attention (cuDNN)", "flash_bprop")
    assert not got.get("other", []) or all("cudnn" not in n for n in got["other"])


def test_the_table_prints_every_row(record, capsys):
    text = gap_table(record["rows"][2])
    assert "| grad accumulation (-0.0 fill, adds) |" in text
    assert text in capsys.readouterr().out


def test_the_fold_and_one_pass_fill_kernels_are_gradient_accumulation():
    """GRAD_FOLD_COPY_FIRST's fold and GRAD_FILL_ONE_PASS's bf16 fill_ (session 10's H200 run
    counted them elsewhere), beside the v2 norm and GLU kernels in their families."""
    acc = "grad accumulation (-0.0 fill, adds)"
    fold = "void graphfp8::(anonymous namespace)::grad_fold_vec_kernel<c10::BFloat16>(uint4*)"
    fill = ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor"
            "<c10::BFloat16>, std::array<char*, 1ul> >(int)")  # fmt: skip
    assert group_of(fold, "other") == acc
    assert group_of(fill, "other") == acc
    assert group_of("graphfp8::norm_bwd_v2_kernel<bf16>", "other").startswith("norm bwd")
    assert group_of("graphfp8::glu_bwd_v2_kernel<bf16>", "other") == "activation bwd"
