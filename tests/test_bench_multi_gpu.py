"""benchmarks/multi_gpu.py on 2 gloo ranks with the tiny preset (not speed: that every configuration
runs through train_run and reports tokens/s and each rank's memory, and that the profile summarises
per rank); --part's split of the runs; benchmarks/overlap.py's interval arithmetic on made-up
kernels; benchmarks/multi_gpu_fit.py's prediction and its search for the largest model that
trains."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from benchmarks import multi_gpu, multi_gpu_fit
from benchmarks.overlap import busy_union, collective_summary, nccl_kind, overlap_length
from graphfp8.training.model import PRESETS
from tests.rank_pool import run_on_ranks
from tests.test_layout import _load

ARGS = ["--presets", "tiny", "--steps", "2", "--microbatches", "2", "--batch", "2", "--seq-len",
        "32"]  # fmt: skip


def _every_config(rank, device, tmp):
    path = f"{tmp}/speed.json"
    out = multi_gpu.run([*ARGS, "--modes", "step", "--profile", "shard-fp8w:step",
                       "--json", path], dist.group.WORLD, "cpu")  # fmt: skip
    runs = out["runs"]
    assert [r["config"] for r in runs] == list(multi_gpu.CONFIGS)
    for r in runs:
        assert "error" not in r, r
        assert r["world"] == 2 and r["tokens_per_s"] > 0 and len(r["memory_per_rank"]) == 2
        per = r["memory_per_rank"][0]["state_bytes_per_parameter"]
        assert per["total"] > 0 and r["memory_per_rank"][0]["max_allocated_bytes"] is None
    # The tiny model's FP8 weights are most of it: sharded FP8 weights hold less than unsharded
    # bf16 parameters with their fp32 masters.
    state = {r["config"]: r["memory_per_rank"][0]["state_bytes_per_parameter"]["total"]
             for r in runs}  # fmt: skip
    assert state["shard-fp8w"] < state["shard"]
    (profile,) = out["profiles"]
    assert profile["name"] == "fp8-fp8w-step-shard" and len(profile["per_rank"]) == 2
    assert profile["per_rank"][0]["kernels"] == 0  # the CPU: no GPU kernels to split
    if rank == 0:
        assert json.load(open(path))["runs"] == runs


def test_every_configuration_runs_and_reports(tmp_path):
    run_on_ranks("gloo", _every_config, str(tmp_path))


def test_parts_split_the_runs():
    argv = ["--presets", "100m,300m", "--configs", "ddp,shard", "--modes", "layers,step"]
    every = multi_gpu.plan(multi_gpu._parse(argv))
    parts = [multi_gpu.plan(multi_gpu._parse([*argv, "--part", f"{i}/3"])) for i in range(3)]
    assert len(every) == 8 and sorted(sum(parts, [])) == sorted(every)
    assert parts[1] == [every[1], every[4], every[7]]


def test_nccl_kernels_against_compute():
    kernels = [("gemm", 0.0, 50.0), ("cast", 40.0, 60.0),  # compute busy 0-60
               ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 55.0, 75.0),  # 5 overlapped
               ("ncclDevKernel_AllGather_RING_LL", 80.0, 100.0)]  # fmt: skip
    s = collective_summary(kernels)
    assert s["span_us"] == 100.0 and s["compute_busy_us"] == 60.0 and s["nccl_busy_us"] == 40.0
    assert s["overlap_us"] == 5.0 and s["nccl_exposed_us"] == 35.0
    assert s["nccl_overlapped"] == pytest.approx(5 / 40) and s["nccl_window"] == [0.55, 1.0]
    assert s["by_kind"] == {"ReduceScatter": {"kernels": 1, "us": 20.0},
                            "AllGather": {"kernels": 1, "us": 20.0}}  # fmt: skip
    assert collective_summary([("gemm", 0.0, 1.0)])["nccl_overlapped"] is None
    assert nccl_kind("ncclKernel_AllReduce_RING_LL_Sum_float") == "AllReduce"
    assert nccl_kind("nvjet_sm90_tst") is None
    assert busy_union([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]
    assert overlap_length([(0, 2), (5, 9)], [(1, 6)]) == 2


@pytest.mark.parametrize(("fits_up_to", "start", "expected"), [
    (3, 3, [("7b", True), ("13b", False)]),  # predicted right: one up fails
    (4, 3, [("7b", True), ("13b", True)]),  # predicted low: one up only
    (1, 3, [("7b", False), ("4b", False), ("2b", True)]),  # predicted high: down to a fit
    (-1, 0, [("1b", False)]),  # nothing fits
])  # fmt: skip
def test_fit_search(fits_up_to, start, expected):
    names = list(multi_gpu_fit.FIT_SHAPES)
    tried = multi_gpu_fit.search(names, start, lambda n: names.index(n) <= fits_up_to, 1e18)
    assert tried == expected


def _speed_json(per_param: float, peak_gib: float) -> dict:
    """A benchmarks/multi_gpu.py result with one 300m shard-fp8w:step run."""
    memory = [{"max_allocated_bytes": peak_gib * 2**30,
               "state_bytes_per_parameter": {"total": per_param}}]  # fmt: skip
    return {"environment": {"world": 8}, "runs": [
        {"config": "shard-fp8w", "mode": "step", "preset": "300m", "memory_per_rank": memory,
         "parameters": multi_gpu_fit.parameters(PRESETS["300m"])}]}  # fmt: skip


def test_fit_writes_what_it_tried_and_the_report_reads_it(tmp_path, monkeypatch):
    speed = tmp_path / "speed_N.json"
    speed.write_text(json.dumps(_speed_json(6.0, 10.0)))
    monkeypatch.setattr(multi_gpu_fit, "_attempt", lambda name, args, out: name in ("1b", "2b"))
    multi_gpu_fit.main([str(speed), "--nproc", "8", "--out", str(tmp_path / "fit"),
                      "--capacity-gib", "140"])  # fmt: skip
    fit = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert fit["tried"][-1] == ["2b", True] and fit["largest_fitting"] == "2b"
    assert fit["next_larger_fails"] == "4b"
    lines, _ = _load("multi_gpu_report")._fit(tmp_path)
    assert "largest that trains: 2b; next larger: 4b" in "\n".join(lines)


def test_fit_prediction_from_a_measured_run():
    """State bytes per parameter times parameters, plus the measured rest scaled by layers x
    hidden: a 300m run at 6 B/param with a 10 GiB peak predicts the 7b shape."""
    ref = multi_gpu_fit.parameters(PRESETS["300m"])
    rest = 10 * 2**30 - 6.0 * ref
    speed = _speed_json(6.0, 10.0)
    rows = {r["name"]: r for r in multi_gpu_fit.predict(speed, 140 * 2**30)}
    shape = multi_gpu_fit.FIT_SHAPES["7b"]
    expect = 6.0 * rows["7b"]["parameters"] + rest * shape.layers * shape.hidden / (24 * 1024)
    assert rows["7b"]["predicted_bytes"] == int(expect)
    assert rows["7b"]["fits"] and not rows["64b"]["fits"]


def test_the_report_puts_the_peers_beside_the_step_graph_rows(tmp_path):
    """Ratios against graphfp8's sharded FP8-weight step graph, and the peers' host and GPU
    busy columns (benchmarks/fsdp_peers.py's profile; "-" when a run has none)."""
    (tmp_path / "peers_N.json").write_text(json.dumps({"runs": [
        {"preset": "100m", "peer": "fsdp2-bf16", "tokens_per_s": 200.0, "losses": [3.0, 2.5],
         "max_allocated_bytes": [2 << 30], "host_ms_per_step": 9.5, "ms_per_step": 10.0,
         "profile": {"calls": 2, "kernels_per_call": 900.0, "busy_fraction": 0.31}},
        {"preset": "100m", "peer": "torchao-fp8", "skipped": "no torchao"}]}))  # fmt: skip
    speed = {"world": 2, "rows": [{"preset": "100m", "config": "shard-fp8w", "mode": "step",
                                   "tokens_per_s": 800.0, "max_allocated_gib": 1.5}]}  # fmt: skip
    lines, peers = _load("multi_gpu_report")._peers(tmp_path, speed)
    assert len(peers) == 2
    assert "| 100m | graphfp8 shard-fp8w step graph | 800 | 1.000 | 1.50 | | | | |" in lines
    assert "| 100m | fsdp2-bf16 | 200 | 0.250 | 2.00 | 2.5000 | 9.5 | 10 | 0.31 |" in lines
    assert "| 100m | torchao-fp8 | no torchao | | | | | | |" in lines
