"""TransformerEngine as a peer in the benchmarks (block, stack, eager, step), when
`import transformer_engine.pytorch` works (the GPU machine's TE install: docs/benchmarking.md,
"TransformerEngine"); without it every TE column is left out.

TE's graphs go through `same_stream_graphed`: TE 2.20's make_graphed_callables warms up on a
fresh stream and captures on another, and under torch 2.11 the backward capture then fails
("operation would make the legacy stream depend on a capturing blocking stream"); making both
one stream avoids it. TE's fused attention does not load on that machine (cuDNN sublibrary), so a
TE TransformerLayer runs its unfused attention (the softmax materialised) and every such column
says so. A TE peer that fails to build is reported in its cell instead of stopping the run.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable

import torch

__all__ = ["TEMLPStack", "TE_UNFUSED", "same_stream_graphed", "te", "te_block_peers",
           "te_linear_peer", "te_recipe", "te_stack_step", "te_step", "try_build"]  # fmt: skip

# The note that goes with every TE TransformerLayer number (see the module docstring).
TE_UNFUSED = "TE: unfused attention, no RoPE"


def te():
    """transformer_engine.pytorch, or None where it does not import."""
    try:
        import transformer_engine.pytorch as te_pt
    except Exception:  # not installed, or its libraries do not load: no TE column
        return None
    return te_pt


def try_build(name: str, build: Callable, failures: dict):
    """build() for a TE peer; on an exception the peer is recorded in failures[name] (its first
    line) and None returned, so that a TE failure costs its column, not the run."""
    try:
        return build()
    except Exception as exc:  # TE on an image it does not fully support: say so, go on
        first = (str(exc).splitlines() or [""])[0][:160]
        failures[name] = f"{type(exc).__name__}: {first}"
        return None


def te_recipe(current: bool = False):
    """TE's DelayedScaling (graphfp8's default recipe: HYBRID, history 1024, max) or its
    Float8CurrentScaling (HYBRID)."""
    from transformer_engine.common import recipe

    if current:
        return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=1024,
                                 amax_compute_algo="max")  # fmt: skip


@contextlib.contextmanager
def _one_stream(te_pt, stream: torch.cuda.Stream):
    """While TE captures: every torch.cuda.Stream() TE asks for is `stream`, and TE's graph
    context runs on it too. Both are put back afterwards."""
    graph_mod = importlib.import_module(te_pt.__name__ + ".graph")
    wrapper = graph_mod._graph_context_wrapper
    make_stream = torch.cuda.Stream

    @contextlib.contextmanager
    def on_stream(*args, **kwargs):
        kwargs.setdefault("stream", stream)
        with wrapper(*args, **kwargs):
            yield

    graph_mod._graph_context_wrapper = on_stream
    torch.cuda.Stream = lambda *a, **k: stream
    try:
        yield
    finally:
        torch.cuda.Stream = make_stream
        graph_mod._graph_context_wrapper = wrapper


def same_stream_graphed(*args, **kwargs):
    """te.make_graphed_callables (same arguments) warming up and capturing on one stream."""
    te_pt = te()
    stream = torch.cuda.Stream()
    with _one_stream(te_pt, stream):
        return te_pt.make_graphed_callables(*args, **kwargs)


def _te_mlp_from(ref):
    """te.LayerNormMLP (tanh GELU) holding the torch block's weights (TE's parameter names are
    graphfp8's)."""
    te_pt = te()
    h = ref.norm.normalized_shape[0]
    m = te_pt.LayerNormMLP(h, 4 * h, eps=ref.norm.eps, activation="gelu",
                           params_dtype=ref.fc1.weight.dtype, device="cuda")  # fmt: skip
    with torch.no_grad():
        m.layer_norm_weight.copy_(ref.norm.weight)
        m.layer_norm_bias.copy_(ref.norm.bias)
        for i, fc in ((1, ref.fc1), (2, ref.fc2)):
            getattr(m, f"fc{i}_weight").copy_(fc.weight)
            getattr(m, f"fc{i}_bias").copy_(fc.bias)
    return m


def te_step(call, x, dy, recipe, microbatches: int) -> Callable[[int], None]:
    """step(i): forward under te.fp8_autocast (graphs too: TE replays inside it) + backward."""
    te_pt = te()

    def step(i):
        with te_pt.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = call(x, is_first_microbatch=i % microbatches == 0)
        y.backward(dy)

    return step


def te_block_peers(ref, x, dy, microbatches: int) -> dict:
    """{name: build()} of the TE MLP block peers (eager, graphed, current scaling graphed), on
    the weights of `ref` (benchmarks/peers.py's TorchMLP); {} without TE."""
    if te() is None:
        return {}

    def graphed(recipe):
        model = _te_mlp_from(ref)
        call = same_stream_graphed(model, (x,), fp8_enabled=True, fp8_recipe=recipe,
                                   fp8_weight_caching=True)  # fmt: skip
        return te_step(call, x, dy, recipe, microbatches)

    return {
        "TE fp8 eager": lambda: te_step(_te_mlp_from(ref), x, dy, te_recipe(), microbatches),
        "TE fp8 graphed": lambda: graphed(te_recipe()),
        "TE fp8 current graphed": lambda: graphed(te_recipe(current=True)),
    }


class _TEStack(torch.nn.Module):
    """`layers` te.TransformerLayers (bshd, causal, no dropout)."""

    def __init__(self, hidden: int, heads: int, layers: int):
        super().__init__()
        te_pt = te()
        self.layers = torch.nn.ModuleList(
            te_pt.TransformerLayer(
                hidden,
                4 * hidden,
                heads,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="causal",
                attn_input_format="bshd",
                params_dtype=torch.bfloat16,
                device="cuda",
            )  # fmt: skip
            for _ in range(layers)
        )

    def forward(self, x, is_first_microbatch=None):
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch)
        return x


def te_stack_step(hidden: int, heads: int, layers: int, x, dy, microbatches: int):
    """step(i) of a graphed stack of TE TransformerLayers (TE_UNFUSED), or None without TE."""
    if te() is None:
        return None
    recipe = te_recipe()
    call = same_stream_graphed(_TEStack(hidden, heads, layers), (x,), fp8_enabled=True,
                               fp8_recipe=recipe, fp8_weight_caching=True)  # fmt: skip
    return te_step(call, x, dy, recipe, microbatches)


class TEMLPStack(torch.nn.Module):
    """`layers` te.LayerNormMLP blocks with residuals (benchmarks/peers.py's G8Stack in TE)."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        te_pt = te()
        self.blocks = torch.nn.ModuleList(
            te_pt.LayerNormMLP(
                hidden, 4 * hidden, activation="gelu", params_dtype=torch.bfloat16, device="cuda"
            )  # fmt: skip
            for _ in range(layers)
        )

    def forward(self, x, is_first_microbatch=None):
        for block in self.blocks:
            x = x + block(x, is_first_microbatch=is_first_microbatch)
        return x


def te_linear_peer(ref, x):
    """fwd() of a te.Linear (cached FP8 weight) with ref's weights, or None without TE."""
    te_pt = te()
    if te_pt is None:
        return None
    n_out, n_in = ref.weight.shape
    lin = te_pt.Linear(n_in, n_out, params_dtype=ref.weight.dtype, device=ref.weight.device)
    with torch.no_grad():
        lin.weight.copy_(ref.weight)
        lin.bias.copy_(ref.bias)
    recipe = te_recipe()
    with te_pt.fp8_autocast(enabled=True, fp8_recipe=recipe):
        lin(x, is_first_microbatch=True)  # fills the weight cache

    def fwd():
        with te_pt.fp8_autocast(enabled=True, fp8_recipe=recipe):
            return lin(x, is_first_microbatch=False)

    return fwd
