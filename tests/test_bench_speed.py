"""benchmarks/speed.py (gpu_check's speed41 step) on the CPU with tiny shapes - not speed: that
every peer runs on the same data with its repeats, ratios against the compiled baseline with
their range, the floor, and the tables - and training/kernel_table.py's attribution of every
kernel."""

from __future__ import annotations

import pytest

from benchmarks import speed
from graphfp8.training.kernel_table import OTHER, category, kernel_table


def test_quick_run_measures_every_peer_against_the_compiled_baseline():
    out = speed.run("cpu", quick=True)
    (row,) = out["rows"]
    peers = row["peers"]
    assert list(peers) == ["bf16-torch-compile", "bf16-graphs", "fp8-graphs", "fp8-step",
                           "fp8-graphs-staged"]  # fmt: skip
    assert peers["fp8-graphs-staged"]["loss"] == peers["fp8-graphs"]["loss"]  # the same bits
    assert row["ceilings"]["source"].startswith("H200 constants")  # no calibration on the CPU
    for name, p in row["peers"].items():
        tps = p["tokens_per_s"]
        assert tps["n"] == 3 and 0 < tps["min"] <= tps["median"] <= tps["max"], name
        r = p["vs_baseline"]
        assert p["baseline"] == "bf16-torch-compile" and r["min"] <= r["median"] <= r["max"]
        assert p["floor_fraction"] == pytest.approx(p["floor_ms"]["total"] / p["ms_per_step"])
        assert p["busy"] is None and p["kernel_table"] is None  # no kernels on the CPU
        assert p["busy_profiled"] is None
        assert 4.5 < p["loss"] < 6.5  # ln 256 = 5.55 after a few steps
    assert row["peers"]["bf16-torch-compile"]["vs_baseline"]["median"] == 1.0
    assert "/ bf16-torch-compile (min-max)" in out["table"] and "of floor" in out["table"]


@pytest.mark.parametrize("name, expected", [
    ("nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_bias_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void graphfp8::(anonymous namespace)::cast_transpose_kernel<__nv_bfloat16, 1>", "fp8 cast"),
    ("unnamed>::amax_kernel<__nv_bfloat16, 0>", "fp8 cast"),
    ("unnamed>::norm_bwd_batched_kernel<__nv_bfloat16, 1, 2>", "norm"),
    ("unnamed>::rope_vec_kernel<__nv_bfloat16>", "rope"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor>",
     "optimizer"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "loss"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor (triton)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor>",
     "aten elementwise/reduce"),
    ("Memset (Device)", "memcpy/memset"),
    ("some_unknown_kernel", OTHER),
])  # fmt: skip
def test_every_kernel_has_a_category(name, expected):
    assert category(name) == expected


def test_kernel_table_attributes_all_time_and_counts_overlap_once():
    kernels = [("nvjet_a", 0.0, 10.0), ("nvjet_a", 20.0, 30.0), ("rope_k", 5.0, 15.0),
               ("mystery", 40.0, 44.0)]  # fmt: skip
    t = kernel_table(kernels, steps=2)
    assert t["kernel_ms"] == pytest.approx(34e-3 / 2)
    assert t["busy_ms"] == pytest.approx(29e-3 / 2)  # [0, 15] + [20, 30] + [40, 44]
    cats = t["categories"]
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(t["kernel_ms"])
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert cats["gemm"]["launches"] == 1.0 and cats[OTHER]["ms"] == pytest.approx(2e-3)
    assert [k["name"] for k in t["kernels"]] == ["nvjet_a", "rope_k", "mystery"]


@pytest.mark.cuda
def test_quick_run_on_a_gpu_calibrates_and_profiles():
    """On a GPU: the ceilings measured, every kernel of the profiled steps in the table, GPU busy
    a fraction of the unprofiled wall."""
    out = speed.run("cuda", quick=True)
    (row,) = out["rows"]
    c = row["ceilings"]
    assert c["source"].startswith("measured on") and min(c["fp8_gemm_tflops"],
                                                         c["bf16_gemm_tflops"], c["copy_tbps"],
                                                         c["attention_tflops"]) > 0  # fmt: skip
    for name, p in row["peers"].items():
        t = p["kernel_table"]
        assert t["kernels"] and t["categories"]["gemm"]["launches"] > 0, name
        assert sum(c["ms"] for c in t["categories"].values()) == pytest.approx(t["kernel_ms"])
        assert 0 < p["busy"] <= 1.05, name  # the union of kernel time over the unprofiled wall
        assert 0 < p["busy_profiled"] <= 1.01, name  # a union inside the profiled wall (clocks)


def test_speed_rows_select_by_preset_and_refuse_unknown_names(monkeypatch):
    monkeypatch.delenv("SPEED_ROWS", raising=False)
    assert speed.selected_rows() == speed.ROWS
    monkeypatch.setenv("SPEED_ROWS", "llama-8b,llama-1b")
    assert [r[0] for r in speed.selected_rows()] == ["llama-1b", "llama-8b"]
    monkeypatch.setenv("SPEED_ROWS", "llama-1b,llama-2b")
    with pytest.raises(ValueError, match="llama-2b"):
        speed.selected_rows()
