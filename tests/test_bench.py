"""`python -m benchmarks ... --quick` runs on the CPU: CI checks that the benchmarks run and
write complete tables (on a CPU the numbers themselves mean nothing)."""

from __future__ import annotations

import json
import math

from benchmarks.__main__ import main


def _numbers(rows: list[dict]) -> list[float]:
    return [v for row in rows for v in row.values() if isinstance(v, float)]


def test_kernels_quick(tmp_path, capsys):
    path = tmp_path / "kernels.json"
    main(["kernels", "--quick", "--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["env"]["device"] == "cpu"
    assert [r["shape"] for r in result["cast_transpose"]] == ["256x256"]
    assert [r["op"] for r in result["fused"]] == [
        "cast_transpose_dbias", "gelu_cast_transpose", "dgelu_cast_transpose_dbias", "rope_qkv",
    ]  # fmt: skip
    assert [r["slots"] for r in result["scale_update"]] == [10, 100]
    assert [r["op"] for r in result["norm"]] == [
        "layernorm_fp8 (+ transpose)", "rmsnorm_fp8 (+ transpose)", "layernorm_bwd",
    ]  # fmt: skip
    numbers = _numbers(result["cast_transpose"] + result["fused"] + result["norm"] +
                       result["scale_update"])  # fmt: skip
    assert numbers and all(math.isfinite(v) and v > 0 for v in numbers)
    printed = capsys.readouterr().out
    assert all(line in printed for line in result["table"].splitlines())
    assert "| cast_transpose_dbias | 128x256 |" in printed


def test_variants_quick(tmp_path, capsys):
    path = tmp_path / "variants.json"
    main(["variants", "--quick", "--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    assert [(r["switch"], r["op"]) for r in result["switches"]] == [
        ("PAIRED_QUANTIZE", "cast_transpose"), ("PAIRED_QUANTIZE", "cast_transpose_dbias"),
        ("DBIAS_IN_KERNEL", "cast_transpose_dbias"), ("PAIRED_QUANTIZE", "gelu_cast_transpose"),
        ("PAIRED_QUANTIZE", "dgelu_cast_transpose_dbias"),
        ("DBIAS_IN_KERNEL", "dgelu_cast_transpose_dbias"),
        ("BLOCKWISE_ACT", "gelu -> 1x128 tiles + a.T tiles"),
        ("BLOCKWISE_ACT", "swiglu -> 1x128 tiles + a.T tiles"),
        ("NORM_BWD_BATCHED", "layernorm_bwd"),
        ("NORM_FWD_TRANSPOSE", "layernorm_fp8 + out_t"),
        ("BLOCKWISE_NORM", "layernorm -> 1x128 tiles + y.T tiles"),
        ("NORM_BWD_STAGED", "layernorm_bwd"),
        ("NORM_BWD_STAGED", "layernorm_bwd + dresidual"),
        ("NORM_BWD_PARAM_IN_KERNEL", "layernorm_bwd"),
        ("NORM_BWD_V2", "rmsnorm_bwd"), ("NORM_BWD_V2", "rmsnorm_bwd + dresidual"),
        ("NORM_BWD_V2", "layernorm_bwd"), ("NORM_BWD_V2", "layernorm_bwd + dresidual"),
        ("GRAD_FILL_ONE_PASS", "-0.0 fill, tiny layer"),
        ("GRAD_FOLD_COPY_FIRST", "first fold, tiny layer"),
    ]  # fmt: skip
    assert [r["op"] for r in result["current"]] == ["cast_transpose", "gelu_cast_transpose"]
    assert [r["shape"] for r in result["block_quantize"]] == ["256x384"]  # issue 42's row
    numbers = _numbers(result["switches"] + result["current"] + result["block_quantize"])
    assert numbers and all(math.isfinite(v) and v > 0 for v in numbers)
    printed = capsys.readouterr().out
    assert all(line in printed for line in result["table"].splitlines())


def test_glu_v2_quick(tmp_path, capsys):
    """Issue 41 cut 3's rows: each SwiGLU kernel with GLU_V2, then GLU_V2_DIV, off and on."""
    path = tmp_path / "glu_v2.json"
    main(["glu-v2", "--quick", "--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    assert [(r["switch"], r["op"], r["shape"]) for r in result["switches"]] == [
        (switch, op, "128x256") for switch in ("GLU_V2", "GLU_V2_DIV")
        for op in ("swiglu fwd", "swiglu bwd")
    ]  # fmt: skip
    numbers = _numbers(result["switches"])
    assert numbers and all(math.isfinite(v) and v > 0 for v in numbers)
    printed = capsys.readouterr().out
    assert all(line in printed for line in result["table"].splitlines())


def test_opcount_quick(tmp_path, capsys):
    """Kernels per TransformerLayer microbatch from the CPU tape: the fused current-scaling path
    replaces each cast's one-slot scale update by nothing and its throwaway cast by an amax
    kernel; delayed scaling has two arena updates (forward, backward) and no amax pass."""
    path = tmp_path / "opcount.json"
    main(["opcount", "--quick", "--device", "cpu", "--json", str(path)])
    rows = json.loads(path.read_text())["layers"]
    delayed, three = rows["fp8 delayed"]["by_op"], rows["fp8 current, three launches"]["by_op"]
    fused = rows["fp8 current, fused"]["by_op"]
    amax_passes = sum(n for op, n in fused.items() if op.endswith("amax"))
    assert amax_passes == three["graphfp8::scale_update"] == 12  # 12 casts per layer
    assert "graphfp8::scale_update" not in fused and delayed["graphfp8::scale_update"] == 2
    assert rows["fp8 current, fused"]["total"] == rows["fp8 delayed"]["total"] + amax_passes - 2
    assert rows["fp8 current, fused"]["total"] < rows["fp8 current, three launches"]["total"]
    assert "| fp8 current, fused |" in capsys.readouterr().out


def test_stack_quick(tmp_path, capsys):
    path = tmp_path / "stack.json"
    main(["stack", "--quick", "--device", "cpu", "--json", str(path)])
    (row,) = json.loads(path.read_text())["stack"]
    assert (row["hidden"], row["layers"], row["batch"], row["seq"]) == (32, 2, 1, 16)
    for key in ("bf16_ms", "fp8_ms", "speedup", "fp8_tflops"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert "| 32 | 1 |" in capsys.readouterr().out


def test_attention_quick(tmp_path, capsys):
    """Every peer, the graphed ones included, runs and is in every table."""
    path = tmp_path / "attention.json"
    main(["attention", "--quick", "--device", "cpu", "--json", str(path)])
    (shape,) = json.loads(path.read_text())["shapes"]
    assert shape["shape"] == [1, 64, 2, 16]
    assert list(shape["peers"]) == [
        "bf16 SDPA", "fp8 ops", "fp8 DotProductAttention", "bf16 RoPE + SDPA (fused QKV)",
        "fp8 MHA chain (fused QKV)", "bf16 SDPA graphed", "fp8 DotProductAttention graphed",
    ]  # fmt: skip
    for name, row in shape["peers"].items():
        for key in ("device_ms", "host_ms", "tflops"):
            assert math.isfinite(row[key]) and row[key] > 0, (name, key)
    assert "graphed fp8 layer / graphed bf16 SDPA" in capsys.readouterr().out


def test_time_host_syncs_before_each_timed_call(monkeypatch):
    """Host enqueue time is measured from an idle device, one call at a time: back-to-back
    enqueues wait for a full launch queue and measure the GPU instead (the step benchmark's
    8- and 24-layer host times did)."""
    from benchmarks import common

    events = []
    monkeypatch.setattr(common, "sync", lambda device: events.append("sync"))
    ms = common.time_host(lambda: events.append("call"), "cpu", warmup=2, iters=3, repeats=2)
    assert ms >= 0.0
    timed = events[2:]  # after the warm-up calls
    assert timed == ["sync", "call"] * 6 + ["sync"]
