"""Per-block FP8 statistics under Float8BlockScaling: the statistics op against its float64 twin
(graphfp8/reference_blockwise.py) on tiles and blocks with outliers, zero and underflowing
blocks and partial tiles; BlockStats' rows eagerly and inside graphs (equal); graphfp8-train
--scaling blockwise --fp8-stats."""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphfp8 as g8
from graphfp8 import reference_blockwise as ref
from graphfp8.numerics import role_digest
from graphfp8.numerics_blockwise import BLOCK_FIELDS, BlockStats
from graphfp8.ops import blockwise
from graphfp8.ops.blockwise_stats import STATS, block_stats
from graphfp8.training import cli as train

BLOCK = g8.Float8BlockScaling()
EXACT = ("saturated", "underflow", "nonzero", "saturated_blocks", "underflow_blocks", "amax")
LOG2 = ("log2_scale_min", "log2_scale_max")  # exact for power-of-2 scales; else CUDA's log2 may
# round the last bit otherwise than the CPU's (H200, 2026-12-02: 1 ulp)


@pytest.fixture(autouse=True)
def _cuda_gemm_path(monkeypatch):
    if not blockwise.GEMM_MODE:
        monkeypatch.setattr(blockwise, "GEMM_MODE", "emulate")


def _hard_input(device) -> torch.Tensor:
    """(272, 400): an outlier row, a zero block, a block of values far below the rest of its
    tile rows (underflow to E4M3 zero), partial tiles both ways."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(272, 400, generator=gen)
    x[5] *= 1e4
    x[128:256, 256:384] = 0.0
    x[:128, :128] *= 1e-3
    x[:128, 0] = 1.0  # one large element per row of that block: the rest underflows
    x[200:210, 390:400] = 7.0
    return x.to(device)


@pytest.mark.parametrize("rows", [1, 128])
@pytest.mark.parametrize("p2", [True, False])
def test_block_stats_equal_the_float64_twin(device, rows, p2):
    x = _hard_input(device)
    quantize = blockwise.quantize_tiles if rows == 1 else blockwise.quantize_blocks
    x_fp8, inv = quantize(x, power_2_scale=p2)
    got = dict(zip(STATS, block_stats(x, x_fp8, inv, rows).tolist(), strict=True))
    want = ref.block_stats(x.cpu(), rows, power_2_scale=p2)
    for name in EXACT + (LOG2 if p2 or device == "cpu" else ()):
        assert got[name] == want[name], (name, got[name], want[name])
    for name in LOG2:
        assert got[name] == pytest.approx(want[name], rel=1e-14), name
    for name in ("signal", "noise", "worst_block_rel_err", "log2_scale_mean"):
        assert got[name] == pytest.approx(want[name], rel=1e-9), name
    assert got["underflow_blocks"] > 0 and got["underflow"] > 0
    assert got["log2_scale_min"] < got["log2_scale_max"]


def test_saturation_is_counted(device):
    """A scale too large for the block (the caller's: a stale stored weight, say) saturates."""
    x = torch.randn(16, 256, device=device)
    x_fp8, inv = blockwise.quantize_tiles(x)
    inv = inv / 4  # a 4x larger scale than the quantizer's
    got = dict(zip(STATS, block_stats(x, x_fp8, inv, 1).tolist(), strict=True))
    assert got["saturated"] > 0 and got["saturated_blocks"] == 32  # every tile has its amax


def _layer(device):
    torch.manual_seed(0)
    return g8.LayerNormMLP(144, 272, params_dtype=torch.bfloat16, device=device)


def _run(model, stats, x, dy, recipe_on: bool):
    stats.enable(True)
    xr = x.clone().requires_grad_()
    if recipe_on:
        with g8.fp8_autocast(recipe=BLOCK):
            y = model(xr)
    else:
        y = model(xr)
    y.backward(dy)
    stats.collect(0, 0)
    return stats.rows()


def test_block_stats_rows_eagerly_and_in_graphs(device):
    x = torch.randn(64, 144, dtype=torch.bfloat16, device=device)
    dy = torch.randn(64, 144, dtype=torch.bfloat16, device=device)
    eager = _layer(device)
    graphed_model = copy.deepcopy(eager)
    with BlockStats(eager) as stats:
        rows = _run(eager, stats, x, dy, True)
    keys = [(r["gemm"], r["role"]) for r in rows]
    assert sorted(keys) == sorted((g, r) for g in ("fc1", "fc2")
                                  for r in ("input", "weight", "grad_output"))  # fmt: skip
    fc1_in = next(r for r in rows if (r["gemm"], r["role"]) == ("fc1", "input"))
    assert fc1_in["blocks"] == 64 * 2 and fc1_in["numel"] == 64 * 144  # 1x128 tiles, K = 144
    w = next(r for r in rows if (r["gemm"], r["role"]) == ("fc1", "weight"))
    assert w["blocks"] == 3 * 2 and w["true_amax"] == float(eager.fc1_weight.detach().abs().max())
    assert set(rows[0]) == set(BLOCK_FIELDS) and "fc1.input" in role_digest(rows)
    sample = torch.randn(64, 144, dtype=torch.bfloat16, device=device, requires_grad=True)
    with BlockStats(graphed_model) as gstats:
        graphed = g8.make_graphed_callables(graphed_model, (sample,), fp8_enabled=True,
                                            fp8_recipe=BLOCK)  # fmt: skip
        grows = _run(graphed, gstats, x, dy, False)
    assert grows == rows  # the statistics ops replayed inside the graphs
    with BlockStats(eager) as stats:  # disabled: nothing kept
        stats.enable(False)
        with g8.fp8_autocast(recipe=BLOCK):
            eager(x)
        stats.collect(1, 0)
        assert stats.rows() == []


class _CountOps(TorchDispatchMode):
    """Counts the dispatcher ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _step_ops(layer, x, dy) -> list:
    """The ops of one blockwise forward and backward of `layer`."""
    xr = x.clone().requires_grad_()
    with _CountOps() as count:
        with g8.fp8_autocast(recipe=BLOCK):
            y = layer(xr)
        y.backward(dy)
    return count.ops


def test_disabled_block_stats_run_no_extra_op(device):
    """Issue 42: installed but disabled, BlockStats computed every operand's statistics (about
    25 float64 ops each) and dropped them; now a disabled eager run has exactly the ops of a run
    without it, and enabling it adds them again."""
    layer = _layer(device)
    x = torch.randn(64, 144, dtype=torch.bfloat16, device=device)
    dy = torch.randn(64, 144, dtype=torch.bfloat16, device=device)
    _step_ops(layer, x, dy)  # first-call work (FP8 state, caches) out of the count
    plain = _step_ops(layer, x, dy)
    with BlockStats(layer) as stats:
        assert _step_ops(layer, x, dy) == plain
        stats.enable(True)
        enabled = _step_ops(layer, x, dy)
        stats.enable(False)
        assert _step_ops(layer, x, dy) == plain
        stats.collect(0)
        assert stats.rows() == []  # nothing recorded while disabled
    stats_op = torch.ops.graphfp8.blockwise_stats.default
    assert enabled.count(stats_op) == 6 and stats_op not in plain  # one kernel per operand


def _replay_ops(graphed, x, dy) -> list:
    """The ops that one call of a graphed callable (forward and backward replays) runs."""
    xr = x.clone().requires_grad_()
    with _CountOps() as count:
        graphed(xr).backward(dy)
    return count.ops


def test_disabled_block_stats_run_one_empty_kernel_per_operand_in_replays():
    """Issue 42: a graph captured with BlockStats installed replayed its ~25 float64 ops per
    operand even while the report was disabled (their result dropped by a where on the flag);
    now a disabled replay runs one blockwise_stats kernel per operand, which writes nothing,
    and an enabled one still reports (on the CPU tape: the ops a replay runs are counted)."""
    x = torch.randn(64, 144, dtype=torch.bfloat16)
    dy = torch.randn(64, 144, dtype=torch.bfloat16)
    sample = torch.randn(64, 144, dtype=torch.bfloat16, requires_grad=True)
    plain_layer, watched_layer = _layer("cpu"), _layer("cpu")
    plain = g8.make_graphed_callables(plain_layer, (sample,), fp8_enabled=True, fp8_recipe=BLOCK)
    with BlockStats(watched_layer) as stats:
        watched = g8.make_graphed_callables(watched_layer, (sample,), fp8_enabled=True,
                                            fp8_recipe=BLOCK)  # fmt: skip
        base = _replay_ops(plain, x, dy)
        disabled = _replay_ops(watched, x, dy)
        extra = list(disabled)
        for op in base:
            extra.remove(op)
        assert [op.name() for op in extra] == ["graphfp8::blockwise_stats"] * 6, len(extra)
        bits = lambda: {k: v.view(torch.int64).clone() for k, v in stats._out.items()}  # noqa: E731
        before = bits()  # unfilled buffers (a capture while disabled allocates, never fills)
        _replay_ops(watched, x, dy)
        assert all(torch.equal(v, before[k]) for k, v in bits().items())  # nothing written
        stats.enable(True)
        _replay_ops(watched, x, dy)
        stats.collect(0)
        assert len(stats.rows()) == 6


def test_per_tensor_stats_refuse_blockwise_gemms(device):
    """FP8Stats reads slots, which blockwise GEMMs lack: it raises instead of reporting nothing;
    BlockStats created after it takes them and hands per-tensor casts on to it."""
    layer = _layer(device)
    x = torch.randn(64, 144, dtype=torch.bfloat16, device=device)
    with g8.numerics.FP8Stats(layer):
        with g8.fp8_autocast(recipe=BLOCK), pytest.raises(RuntimeError, match="BlockStats"):
            layer(x)
        with BlockStats(layer) as stats:
            stats.enable(True)
            with g8.fp8_autocast(recipe=BLOCK):
                layer(x)
            with g8.fp8_autocast(recipe=g8.DelayedScaling()):
                layer(x)  # a per-tensor cast: FP8Stats' (no error)
            stats.collect(0)
            assert {r["role"] for r in stats.rows()} == {"input", "weight"}


@pytest.mark.parametrize("every", [1, 2])
def test_train_with_blockwise_fp8_stats(tmp_path, every):
    """Every step, or every other one: the step graph's replays keep the statistics of the
    enabled steps only (its ops are nodes whatever the setting)."""
    argv = ["--batch", "2", "--seq-len", "32", "--microbatches", "1", "--device", "cpu",
            "--data", "synthetic", "--val-batches", "1", "--steps", str(2 * every),
            "--out", str(tmp_path), "--scaling", "blockwise", "--fp8-stats", str(every),
            "--graphs", "step"]  # fmt: skip
    assert train.main(argv) == 0
    (run,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    with open(run["fp8_stats"]["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == set(BLOCK_FIELDS)
    assert {r["step"] for r in rows} == {"0", str(every)}
    assert {r["role"] for r in rows} == {"input", "weight", "grad_output"}
