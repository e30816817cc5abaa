"""torch.compile through and around graphfp8 layers (docs/architecture.md, "torch.compile"):
compiled == eager bit for bit (outputs, every gradient, FP8 scales and histories), and no compile
path - tracing, a failed compile, a recompile - leaves a module different from eager use.

Compiling is slow on the CPU (inductor builds C++): the tests of numerics compile with inductor,
the tests of dynamo's behaviour (guards, graph breaks, errors) with backends that build nothing.
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import backward_and_compare, compare_models
from tests.helpers import CUDA_PARAM
from tests.modules.common import build, fp8_state, input_shape

RECIPE = g8.DelayedScaling(amax_history_len=4)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch: no cache entry of another test's backend or guards."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(model: nn.Module, device: str, scale: float = 1.0):
    """The same bf16 input twice, each its own leaf that requires grad."""
    x = torch.randn(input_shape(model), dtype=torch.bfloat16, device=device) * scale
    return x.clone().requires_grad_(), x.clone().requires_grad_()


def _microbatch(eager_call, compiled_call, eager, compiled, device, first, what: str,
                compiled_fp8: bool = True) -> None:  # fmt: skip
    """One forward + backward of each (the eager one under fp8_autocast, the compiled one too
    unless it carries its own FP8 state: graphed callables), then everything compared."""
    xe, xc = _inputs(eager, device)
    with g8.fp8_autocast(recipe=RECIPE):
        ye = eager_call(xe, first)
    # A graphed callable carries its own FP8 settings: called outside any fp8_autocast region.
    region = g8.fp8_autocast(recipe=RECIPE) if compiled_fp8 else contextlib.nullcontext()
    with region:
        yc = compiled_call(xc, first)
    backward_and_compare(ye, yc, xe, xc, what)
    compare_models(eager, compiled, what)


def _train_side_by_side(eager, compiled, compiled_call, device, steps=3, mbs=2) -> None:
    """`steps` AdamW steps of `mbs` microbatches each (is_first_microbatch on the first), the
    compiled call against the eager module, compared after every microbatch and step."""
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    eager_call = lambda x, first: eager(x, is_first_microbatch=first)  # noqa: E731
    for step in range(steps):
        for mb in range(mbs):
            _microbatch(eager_call, compiled_call, eager, compiled, device, mb == 0,
                        f"step {step} mb {mb}")  # fmt: skip
        for opt in (opt_e, opt_c):
            opt.step()
            opt.zero_grad(set_to_none=True)
        compare_models(eager, compiled, f"after step {step}")


def _eager_use_matches(model, twin, device, what: str) -> None:
    """The module used eagerly afterwards (a step of two microbatches) equals its twin."""
    call = lambda m: lambda x, first: m(x, is_first_microbatch=first)  # noqa: E731
    for mb in range(2):
        _microbatch(call(twin), call(model), twin, model, device, mb == 0, f"{what}, mb {mb}")


# The example ---------------------------------------------------------------------------


def test_compiled_call_with_autocast_inside_then_eager(device):
    """Issue 18: compiling a function that enters fp8_autocast and calls a LayerNormMLP ran, its
    backward failed (the FP8 weight workspace had lost its transpose buffer) and so did every
    eager use afterwards. Now: compiled == eager, and eager use afterwards == eager."""
    model = build("LayerNormMLP", device=device)
    twin = copy.deepcopy(model)

    def step(m, x, first):
        with g8.fp8_autocast(recipe=RECIPE):
            return m(x, is_first_microbatch=first)

    compiled = torch.compile(step)
    for mb in range(3):
        xe, xc = _inputs(model, device)
        ye, yc = step(twin, xe, mb == 0), compiled(model, xc, mb == 0)
        ye.float().sum().backward()
        yc.float().sum().backward()
        assert_bitwise_equal(yc, ye, f"mb {mb}: output")
        assert_bitwise_equal(xc.grad, xe.grad, f"mb {mb}: dgrad")
        compare_models(twin, model, f"mb {mb}")
    _eager_use_matches(model, twin, device, "eager after compiled")


# Compiled == eager ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
def test_compiled_equals_eager(device, kind):
    """torch.compile(layer) under fp8_autocast, 3 steps x 2 microbatches, against the eager
    layer: bit for bit. The FP8 layers run eagerly inside the compiled code; the TransformerLayer's
    attention, RoPE and residual adds are compiled by inductor (and stay bit-exact)."""
    eager = build(kind, device=device)
    model = copy.deepcopy(eager)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    _train_side_by_side(eager, model, lambda x, first: compiled(x, is_first_microbatch=first),
                        device)  # fmt: skip
    if kind == "TransformerLayer":
        assert counter.frame_count > 0, "inductor compiled nothing around the FP8 layers"
    _eager_use_matches(model, eager, device, "eager after compiled")


# Dynamo's behaviour: guards, graph breaks, errors (backends that build nothing) ----------------


def test_compiled_layer_follows_the_fp8_switch(device):
    """One compiled layer called outside, inside, then outside fp8_autocast: each call equals
    the eager layer in the same mode (dynamo guards on the FP8 switch, recompiles, and never
    reuses the high-precision graph under FP8)."""
    model = build("LayerNormMLP", device=device)
    twin = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(input_shape(model), dtype=torch.bfloat16, device=device)
    for fp8 in (False, True, False, True):
        with g8.fp8_autocast(enabled=fp8, recipe=RECIPE):
            yc, ye = compiled(x), twin(x)
        assert_bitwise_equal(yc, ye, f"fp8={fp8}")
    assert counter.frame_count == 1, "only the high-precision forward is a graph"
    for (name, a), (_, b) in zip(fp8_state(model), fp8_state(twin), strict=True):
        assert_bitwise_equal(a, b, name)


def test_fullgraph_names_the_fp8_layer(device):
    """fullgraph=True under fp8_autocast raises, naming the layer that breaks the graph, before
    anything ran; outside fp8_autocast the layer is one graph. The module is unharmed."""
    model = build("LayerNormMLP", device=device)
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(input_shape(model), dtype=torch.bfloat16, device=device)
    with g8.fp8_autocast(recipe=RECIPE), pytest.raises(Exception) as info:
        compiled(x)
    assert "graphfp8.LayerNormMLP runs its FP8 forward eagerly" in str(info.value)
    assert "fullgraph=True" in str(info.value)
    assert model.fp8_meta is None, "a failed fullgraph compile ran FP8 code"
    assert_bitwise_equal(compiled(x), twin(x), "high precision, fullgraph")
    _eager_use_matches(model, twin, device, "eager after a failed fullgraph compile")


class _Around(nn.Module):
    """Torch ops before and after a graphfp8 layer: the graphs torch.compile builds around it."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x, is_first_microbatch=None):
        return self.layer(x.relu(), is_first_microbatch=is_first_microbatch).relu()


class InjectedFailure(RuntimeError):
    pass


def _failing_backend(fail_at: int):
    """A backend that compiles graphs as aot_eager does, but raises on its `fail_at`-th graph."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        if len(calls) == fail_at:
            raise InjectedFailure(f"injected failure compiling graph {fail_at}")
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    return backend


def _workspaces(model: nn.Module) -> list[tuple[str, object]]:
    """Every FP8 weight workspace's buffers and the eager weight-cache flag, named."""
    out = []
    for name, mod in model.named_modules():
        cache = getattr(mod, "weight_cache", None)
        if cache is None:
            continue
        for key, ws in cache.workspaces.items():
            out += [(f"{name}.{key}.data", ws._data), (f"{name}.{key}.t", ws._transpose),
                    (f"{name}.{key}.scale_inv", ws._scale_inv)]  # fmt: skip
        out.append((f"{name}.cache_valid", cache.valid))
    return out


@pytest.mark.parametrize("fail_at", [1, 2], ids=["before-layer", "after-layer"])
def test_failed_compile_leaves_the_module_as_eager_would(device, fail_at):
    """The compile of the graph before (1) or after (2) the FP8 layer fails. Before: nothing
    of the layer ran, its state is untouched. After: the layer's forward ran eagerly, exactly as
    an eager forward would have. Either way the module then trains eagerly, and compiled again
    with a working backend, bit for bit like a twin that never saw torch.compile."""
    model = _Around(build("LayerNormMLP", device=device))
    twin = copy.deepcopy(model)
    x = torch.randn(input_shape(model.layer), dtype=torch.bfloat16, device=device)
    for m in (model, twin):  # FP8 state and workspaces exist before the failure
        with g8.fp8_autocast(recipe=RECIPE):
            m(x, is_first_microbatch=True)
    before = [(n, v.clone() if isinstance(v, torch.Tensor) else v)
              for n, v in fp8_state(model) + _workspaces(model)]  # fmt: skip
    x = torch.randn(input_shape(model.layer), dtype=torch.bfloat16, device=device)
    compiled = torch.compile(model, backend=_failing_backend(fail_at))
    with g8.fp8_autocast(recipe=RECIPE), pytest.raises(Exception, match="injected failure"):
        compiled(x, is_first_microbatch=True)
    if fail_at == 1:
        after = fp8_state(model) + _workspaces(model)
        for (name, a), (_, b) in zip(after, before, strict=True):
            if isinstance(a, torch.Tensor):
                assert_bitwise_equal(a, b, name)
            else:
                assert a == b, name
    else:
        with g8.fp8_autocast(recipe=RECIPE):
            twin(x, is_first_microbatch=True)  # what the compiled call ran before failing
    _eager_use_matches(model, twin, device, "eager after a failed compile")
    recompiled = torch.compile(model, backend="aot_eager")
    call = lambda x, first: recompiled(x, is_first_microbatch=first)  # noqa: E731
    twin_call = lambda x, first: twin(x, is_first_microbatch=first)  # noqa: E731
    for mb in range(2):
        _microbatch(twin_call, call, twin, model, device, mb == 0, f"recompiled, mb {mb}")


# torch.compile and make_graphed_callables -----------------------------------------------------


def test_graphing_compiled_code_names_the_supported_order(device):
    """torch.compile first, then make_graphed_callables: a TypeError that says to capture first
    and compile around, raised before anything runs (whatever part is compiled)."""
    layer = build("LayerNormMLP", device=device)
    in_place = _Around(layer)
    in_place.layer.compile()
    cases = {
        "torch.compile(module)": torch.compile(layer),
        "compiled function": torch.compile(lambda x: layer(x)),
        "compiled submodule": _Around(torch.compile(layer)),
        "Module.compile()": in_place,
    }
    sample = torch.randn(input_shape(layer), dtype=torch.bfloat16, device=device)
    for what, func in cases.items():
        with pytest.raises(TypeError, match="capture the plain module and compile around") as e:
            g8.make_graphed_callables(func, (sample,), fp8_enabled=True, fp8_recipe=RECIPE)
        assert "not supported" in str(e.value), what
    assert layer.fp8_meta is None, "a refused capture ran the layer"


def _compile_backend(device: str) -> str:
    # On the CPU the compiled parts are a check of dynamo's treatment of the replay, not of
    # inductor's numerics (the train test compiles around graphed blocks with inductor).
    return "inductor" if device == "cuda" else "aot_eager"


def test_compile_around_graphed_callables(device):
    """make_graphed_callables first, then torch.compile of a model that calls the graphed layer:
    dynamo runs the replay as one opaque call; 3 steps x 2 microbatches equal eager."""
    eager = _Around(build("LayerNormMLP", device=device))
    model = copy.deepcopy(eager)
    sample = torch.randn(input_shape(model.layer), dtype=torch.bfloat16, device=device,
                         requires_grad=True)  # fmt: skip
    g8.make_graphed_callables(model.layer, (sample,), fp8_enabled=True, fp8_recipe=RECIPE,
                              fp8_weight_caching=True)  # fmt: skip
    counter = torch._dynamo.testing.CompileCounterWithBackend(_compile_backend(device))
    compiled = torch.compile(model, backend=counter)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_call = lambda x, first: eager(x, is_first_microbatch=first)  # noqa: E731
    compiled_call = lambda x, first: compiled(x, is_first_microbatch=first)  # noqa: E731
    for step in range(3):
        for mb in range(2):
            _microbatch(eager_call, compiled_call, eager, model, device, mb == 0,
                        f"step {step} mb {mb}", compiled_fp8=False)  # fmt: skip
        for opt in (opt_e, opt_c):
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert counter.frame_count > 0, "nothing was compiled around the graphed layer"


@pytest.mark.parametrize("device", [CUDA_PARAM])
def test_compiled_code_inside_a_captured_function_runs_eagerly(device):
    """A plain function that calls torch.compile'd code, graphed: the capture runs the compiled
    code eagerly (inductor's kernels never enter a graph), so graphed == eager."""
    layer = build("LayerNormMLP", device=device)
    twin = copy.deepcopy(layer)
    pre = lambda h: torch.nn.functional.gelu(h) * 3.0  # noqa: E731
    compiled_pre = torch.compile(pre)
    sample = torch.randn(input_shape(layer), dtype=torch.bfloat16, device=device,
                         requires_grad=True)  # fmt: skip
    graphed = g8.make_graphed_callables(lambda x: layer(compiled_pre(x)), (sample,),
                                        fp8_enabled=True, fp8_recipe=RECIPE)  # fmt: skip
    for mb in range(3):  # a graphed plain function gives input grads only
        xe, xg = _inputs(layer, device)
        with g8.fp8_autocast(recipe=RECIPE):
            ye = twin(pre(xe))
        yg = graphed(xg)
        ye.float().sum().backward()
        yg.float().sum().backward()
        assert_bitwise_equal(yg, ye, f"mb {mb}: output")
        assert_bitwise_equal(xg.grad, xe.grad, f"mb {mb}: dgrad")
        for (name, a), (_, b) in zip(fp8_state(layer), fp8_state(twin), strict=True):
            assert_bitwise_equal(a, b, f"mb {mb}: {name}")


# The train CLI ---------------------------------------------------------------------------------


def test_train_compile_matches_the_run_without(device, tmp_path):
    """graphfp8-train --compile (embedding and loss compiled around the graphed FP8 blocks)
    trains like the run without it: the same losses within the tolerance of docs/architecture.md
    (inductor sums the embedding and norm gradients in another order)."""
    from graphfp8.training import cli as train

    # The tiny preset on every device (the 100m one at full lr from step 1 diverges on 2 steps).
    argv = ["--preset", "tiny", "--batch", "2", "--seq-len", "32", "--microbatches", "2",
            "--steps", "2", "--log-every", "2", "--data", "synthetic", "--val-batches", "1",
            "--device", device, "--compare", "fp8:graphs"]  # fmt: skip
    torch._dynamo.utils.counters.clear()
    losses = {}
    for flag in ([], ["--compile"]):
        out = tmp_path / (flag[0][2:] if flag else "plain")
        assert train.main([*argv, *flag, "--out", str(out)]) == 0
        (run,) = json.loads((out / "summary.json").read_text())["runs"]
        losses[run["name"]] = run["losses"]
    plain, compiled = losses["fp8-graphs"], losses["fp8-graphs-compile"]
    assert len(compiled) == 2 and compiled[-1] < compiled[0]
    torch.testing.assert_close(compiled, plain, rtol=1e-3, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "--compile compiled nothing"
