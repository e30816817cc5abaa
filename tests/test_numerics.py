"""graphfp8.numerics: the cast-statistics kernel against its twin, and FP8Stats on layers in
eager runs and in captured graphs (the same rows bit for bit), with the training unchanged."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

import graphfp8 as g8
from graphfp8 import ops, reference
from graphfp8.fp8 import observe
from graphfp8.numerics import FIELDS, FP8Stats, plot_stats, role_digest
from graphfp8.ops.stats import STATS_MODES
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import FP8_DTYPES, HP_DTYPES

RECIPE = g8.DelayedScaling(amax_history_len=4)


def _mode_inputs(mode: str, dtype, device):
    rows, cols = 67, 48
    x = (torch.randn(rows, cols, device=device) * 3).to(dtype)
    x[3, 5], x[7, 1], x[9, 9] = 1e4, 1e-6, float("nan")  # saturates, underflows, skipped
    kw = {}
    if mode == "dgelu":
        kw["act_in"] = (torch.randn(rows, cols, device=device) * 3).to(dtype)
    if mode in ("layernorm", "rmsnorm"):
        kw["rsigma"] = torch.rand(rows, device=device) + 0.5
        kw["gamma"] = (torch.randn(cols, device=device)).to(dtype)
        if mode == "layernorm":
            kw["mu"] = torch.randn(rows, device=device)
            kw["beta"] = torch.randn(cols, device=device).to(dtype)
    return x, kw


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("mode", sorted(STATS_MODES))
def test_cast_stats_kernel_matches_twin(mode, dtype, fp8_dtype, zero_centered, device):
    if zero_centered and mode not in ("layernorm", "rmsnorm"):
        pytest.skip("zero_centered_gamma is a norm argument")
    x, kw = _mode_inputs(mode, dtype, device)
    scale, recorded = torch.tensor([7.5], device=device), torch.tensor([3.25], device=device)
    zc = dict(zero_centered_gamma=zero_centered)
    got = ops.reduce_cast_stats(ops.cast_stats(x, scale, recorded, fp8_dtype, mode=mode, **kw,
                                               **zc)).cpu()  # fmt: skip
    want = torch.zeros(1, 8, dtype=torch.float64)
    cpu = {k: v.cpu() for k, v in kw.items()}
    reference.cast_stats(x.cpu(), cpu.get("act_in"), cpu.get("mu"), cpu.get("rsigma"),
                         cpu.get("gamma"), cpu.get("beta"), STATS_MODES[mode], zero_centered,
                         scale.cpu(), recorded.cpu(), fp8_dtype == torch.float8_e4m3fn, None,
                         None, want)  # fmt: skip
    want = ops.reduce_cast_stats(want)
    # Counts and maxima exactly; the float64 sums within rounding of another summation order.
    # GELU/dGELU: the kernels' tanhf differs from torch's tanh by ulps (on the CPU too: torch's
    # is vectorised), which moves a few results by one rounding step (tests/ops/test_cast_fused).
    exact = mode not in ("gelu", "dgelu")
    if exact:
        assert torch.equal(got[[0, 1, 2, 3, 6, 7]], want[[0, 1, 2, 3, 6, 7]]), (got, want)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=0.0)
    else:  # where tanh is +-1 in one and not the other, a tiny result is 0 or not: counts move
        cols = [0, 1, 4, 5, 6, 7]
        torch.testing.assert_close(got[cols], want[cols], rtol=1e-2, atol=0.0)
        torch.testing.assert_close(got[2:4], want[2:4], rtol=0.0, atol=0.02 * x.numel())
    if mode == "identity":
        assert got[1] == 1 and got[2] >= 1, "the planted saturation and underflow were counted"


def test_cast_stats_gated(device):
    x = torch.randn(32, 16, device=device)
    one = torch.ones(1, device=device)
    for kw in (dict(enabled=torch.zeros(1, device=device)), dict(skip=one)):
        out = torch.full((ops.stats_partials(device), 8), 7.0, dtype=torch.float64, device=device)
        ops.cast_stats(x, one, one, torch.float8_e4m3fn, out=out, **kw)
        assert bool((out == 7.0).all()), f"{kw}: nothing may be written"
    with pytest.raises(ValueError, match="mode must be one of"):
        ops.cast_stats(x, one, one, torch.float8_e4m3fn, mode="tanh")
    with pytest.raises(RuntimeError, match="'gamma' is required"):
        ops.cast_stats(x, one, one, torch.float8_e4m3fn, mode="rmsnorm",
                       rsigma=torch.ones(32, device=device))  # fmt: skip


def _layer(device, recipe=RECIPE):
    torch.manual_seed(0)
    return g8.TransformerLayer(64, 4, 256, max_seq_len=32, params_dtype=torch.bfloat16,
                               device=device)  # fmt: skip


def _train(layer, call, stats, steps=2, mbs=2, seed=5):
    """Microbatches of random data through `call`, stats enabled on every step; returns losses."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    device = next(layer.parameters()).device
    for step in range(steps):
        if stats is not None:
            stats.enable(step % 2 == 0)
        for mb in range(mbs):
            x = torch.randn(2, 32, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
            loss = call(x, mb == 0).float().square().mean()
            loss.backward()
            losses.append(loss.detach())
            if stats is not None:
                stats.collect(step, mb)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _eager(layer, recipe=RECIPE):
    def call(x, first):
        with g8.fp8_autocast(recipe=recipe):
            return layer(x, is_first_microbatch=first)

    return call


@pytest.mark.parametrize("recipe", [RECIPE, g8.Float8CurrentScaling()], ids=["delayed", "current"])
def test_eager_rows_are_exact(recipe, device):
    layer = _layer(device)
    with FP8Stats(layer) as stats:
        _train(layer, _eager(layer, recipe), stats, steps=3)
        rows = stats.rows()
    assert observe.observer() is None
    assert {r["step"] for r in rows} == {0, 2}, "steps with the kernels switched off give no rows"
    per_mb = {(r["step"], r["microbatch"]): 0 for r in rows}
    for r in rows:
        per_mb[(r["step"], r["microbatch"])] += 1
        assert set(r) == set(FIELDS)
        assert 0.0 <= r["saturated_frac"] <= 1.0 and 0.0 <= r["underflow_frac"] <= 1.0
        if r["role"] == "weight":
            assert r["microbatch"] == 0, "a cached weight is not cast again"
    # microbatch 0: 4 inputs, 4 weights, 4 gradients; later ones without the weights
    assert per_mb[(0, 0)] == 12 and per_mb[(0, 1)] == 8, per_mb
    for r in rows:
        if isinstance(recipe, g8.DelayedScaling) or r["role"] != "weight":
            torch.testing.assert_close(r["recorded_amax"], r["true_amax"],
                                       rtol=0 if isinstance(recipe, g8.DelayedScaling) else 1e-6,
                                       atol=0)  # fmt: skip


def test_stats_leave_training_unchanged_and_graphs_equal_eager(device):
    plain = _layer(device)
    observed, graphed_model = copy.deepcopy(plain), copy.deepcopy(plain)
    base = _train(plain, _eager(plain), None)
    with FP8Stats(observed) as stats_e:
        eager_losses = _train(observed, _eager(observed), stats_e)
        rows_e = stats_e.rows()
    with FP8Stats(graphed_model) as stats_g:
        sample = torch.randn(2, 32, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
        graphed = g8.make_graphed_callables(graphed_model, (sample,), fp8_enabled=True,
                                            fp8_recipe=RECIPE, fp8_weight_caching=True)  # fmt: skip
        call = lambda x, first: graphed(x, is_first_microbatch=first)  # noqa: E731
        graphed_losses = _train(graphed_model, call, stats_g)
        rows_g = stats_g.rows()
    for a, b, c in zip(base, eager_losses, graphed_losses, strict=True):
        assert_bitwise_equal(b, a, "stats change no loss")
        assert_bitwise_equal(c, a, "graphed == eager")
    assert rows_e and rows_g == rows_e, "graphed statistics equal eager ones"


def test_stats_after_capture_raise(device):
    layer = _layer(device)
    sample = torch.randn(2, 32, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=RECIPE)
    with pytest.raises(RuntimeError, match="before make_graphed_callables"):
        FP8Stats(layer)


def test_no_allocation_inside_a_capture():
    """FP8Stats makes its buffers before a capture (graphfp8/numerics.py, _not_capturing): a
    slot first seen inside a recording raises, naming the fix, before any buffer is made (it
    allocated a zeroed chunk there, whose fill every replay of the tape ran again)."""
    from graphfp8.graphs.backends import TapeGraph  # noqa: PLC0415

    layer = _layer("cpu")
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=RECIPE):
        layer(x)  # the slots exist; the observer below has seen none of their casts
    with FP8Stats(layer) as stats:
        with pytest.raises(RuntimeError, match="inside a graph capture.*eagerly"):
            with TapeGraph().capture(), g8.fp8_autocast(recipe=RECIPE):
                layer(x)
        assert not any(stats._chunks.values()) and not stats._slots, "nothing made in the capture"
        with g8.fp8_autocast(recipe=RECIPE):
            layer(x)  # eagerly: the buffers are made
        assert stats._slots


def test_csv_and_plot(tmp_path):
    layer = _layer("cpu")
    with FP8Stats(layer) as stats:
        _train(layer, _eager(layer), stats, steps=1)
        path = stats.write_csv(tmp_path / "s.csv")
        rows = stats.rows()
    assert path.read_text().splitlines()[0] == ",".join(FIELDS)
    assert len(path.read_text().splitlines()) == len(rows) + 1
    png = plot_stats(rows, tmp_path / "s.png")
    assert png is None or png.stat().st_size > 1000


def test_fp8_attention_roles(device):
    """FP8 attention's casts in the report (graphfp8.numerics, "FP8 attention"): dO exact like a
    GEMM's gradient; q, k, v (rotated inside the RoPE + FP8 kernel), O, dQ, dK, dV with scale and
    recorded amax only; graphed rows equal eager rows."""
    from tests.modules.attention_common import MHA, layer_and_input

    def run(graphed: bool):
        layer, sample = layer_and_input(device)
        g = torch.Generator().manual_seed(5)
        with FP8Stats(layer) as stats:
            stats.enable(True)
            call = layer
            if graphed:
                call = g8.make_graphed_callables(layer, (sample.clone().requires_grad_(),),
                                                 fp8_enabled=True, fp8_recipe=MHA)  # fmt: skip
            for step in range(2):
                x = torch.randn(sample.shape, generator=g).to(sample).requires_grad_()
                with contextlib.nullcontext() if graphed else g8.fp8_autocast(recipe=MHA):
                    y = call(x)
                y.float().square().mean().backward()
                stats.collect(step)
            return stats.rows()

    rows = run(False)
    attn = {r["role"]: r for r in rows if r["gemm"] == "attention"}
    assert set(attn) == {"q", "k", "v", "o", "do", "dq", "dk", "dv"}
    assert all(r["layer"] == "core_attention" for r in attn.values())
    assert attn["do"]["recorded_amax"] == attn["do"]["true_amax"] > 0
    assert math.isfinite(attn["do"]["sqnr_db"])
    for role in ("q", "k", "v", "o", "dq", "dk", "dv"):
        r = attn[role]
        assert r["true_amax"] is None and r["sqnr_db"] is None and r["recorded_amax"] > 0, role
    digest = role_digest(rows)
    assert digest["attention.o"]["saturated_mean"] is None
    assert digest["attention.do"]["amax_mismatches"] == 0
    assert run(True) == rows, "graphed statistics equal eager ones"
