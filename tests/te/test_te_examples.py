"""TransformerEngine's own documentation examples run on graphfp8.te with only TE's import changed
(tests/te/te_examples.py lists every other change: on the CPU smaller layers, host timers,
fewer timed iterations), and do what they say: FP8 layers ran in FP8, the graphed model was
captured."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
import graphfp8.te as te
from tests.te import te_examples


@pytest.fixture
def dev(device) -> str:
    """The examples' FP8 layers take TE's default device: CUDA when present, else the CPU."""
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU variant runs on CPU-only machines (TE's default device is CUDA)")
    return device


def _ran_in_fp8(module: torch.nn.Module) -> bool:
    fp8 = [m for m in module.modules() if isinstance(m, g8.FP8Module) and m.num_gemms]
    return bool(fp8) and all(m.fp8_meta is not None for m in fp8)


def test_readme(dev):
    ns = te_examples.run(te_examples.README, dev)
    assert isinstance(ns["model"], te.Linear) and _ran_in_fp8(ns["model"])
    assert ns["fp8_recipe"].fp8_format is g8.Format.E4M3
    assert ns["model"].weight.grad is not None and torch.isfinite(ns["out"]).all()


def test_quickstart(dev):
    """TE's quickstart notebook (v2.8: te.fp8_autocast(enabled=True, fp8_recipe=...)): the plain
    torch layer, then te.Linear / LayerNorm, LayerNormLinear / LayerNormMLP and TransformerLayer,
    then TransformerLayer in FP8, each trained by its speedometer."""
    ns = te_examples.run(te_examples.QUICKSTART, dev)
    layer = ns["te_transformer"]
    assert isinstance(layer, te.TransformerLayer) and _ran_in_fp8(layer)
    assert not _ran_in_fp8(ns["fused_te_transformer"])  # never under fp8_autocast
    assert ns["y"].shape == ns["x"].shape and torch.isfinite(ns["y"]).all()
    # utils.share_parameters_with_*: TE's names reach graphfp8's parameters
    assert layer.layernorm_mlp.fc1_weight is ns["basic_transformer"].mlp.linear1.weight


def test_getting_started(dev):
    """TE's getting-started script (the quickstart's successor, te.autocast(recipe=...)), with
    te.DotProductAttention (sbhd, causal, dropout 0.1) and its CSV summary."""
    ns = te_examples.run(te_examples.GETTING_STARTED, dev)
    for name in ("te_unfused_fp8", "te_fused_fp8", "te_transformer_layer"):
        assert _ran_in_fp8(ns[name]), name
    assert ns["te_unfused_attn"].attention.attention_dropout == 0.1
    assert ns["time_te_transformer_layer"] > 0


def test_cuda_graphs(dev):
    """TE's CUDA-graphs example (activation offloading off: graphfp8 has none, and says so)."""
    ns = te_examples.run(te_examples.CUDA_GRAPHS, dev)
    assert ns["graphed_model"].captured_ops()["forward"]
    assert all(p.grad is not None for p in ns["model"].parameters())
    with pytest.raises(NotImplementedError, match="get_cpu_offload_context: enabled=True"):
        te.get_cpu_offload_context(enabled=True, model_layers=12, num_layers=3)


def test_every_change_is_listed_and_applies(tmp_path):
    """The runner changes TE's import lines on every device and, beyond the CUDA-graphs example's
    offloading flag, nothing else on the GPU."""
    for example in te_examples.ALL:
        main = te_examples.prepared(example, "cuda", tmp_path)
        text = main.read_text()
        assert "transformer_engine" not in text and "graphfp8.te" in text
        source = te_examples._source(te_examples.EXAMPLES / example.main)
        changed = [a for a, b in zip(source.splitlines(), text.splitlines(), strict=True) if a != b]
        assert all("transformer_engine" in line or "enabled=True" in line for line in changed)
