"""The models that the benchmarks race: the MLP block of docs/benchmarking.md as bf16 torch, torchao
float8, graphfp8 (eager, graphed, compiled) and TransformerEngine where it imports
(te_peers.py), each built on demand into a `step(i)` callable that runs forward + backward
of microbatch i."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import graphfp8 as g8
from benchmarks.te_peers import te_block_peers

__all__ = ["TorchMLP", "G8Stack", "torchao_available", "make_peers"]

MICROBATCHES_PER_STEP = 4
RECIPE = g8.DelayedScaling()
CURRENT = g8.Float8CurrentScaling()


class TorchMLP(nn.Module):
    """LayerNorm(h) -> Linear(h, 4h) -> GELU(tanh) -> Linear(4h, h), plain torch."""

    def __init__(self, hidden: int, dtype=torch.bfloat16, device="cuda"):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, dtype=dtype, device=device)
        self.fc1 = nn.Linear(hidden, 4 * hidden, dtype=dtype, device=device)
        self.fc2 = nn.Linear(4 * hidden, hidden, dtype=dtype, device=device)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class G8Stack(nn.Module):
    """`layers` graphfp8 LayerNormMLP blocks with residuals."""

    def __init__(self, hidden: int, layers: int, dtype=torch.bfloat16, device="cuda"):
        super().__init__()
        self.blocks = nn.ModuleList(
            g8.LayerNormMLP(hidden, 4 * hidden, params_dtype=dtype, device=device)
            for _ in range(layers)
        )

    def forward(self, x, is_first_microbatch=None):
        for block in self.blocks:
            x = x + block(x, is_first_microbatch=is_first_microbatch)
        return x


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:
        return False
    return True


def _g8_from_torch(ref: TorchMLP) -> g8.LayerNormMLP:
    h = ref.norm.normalized_shape[0]
    m = g8.LayerNormMLP(h, 4 * h, params_dtype=ref.fc1.weight.dtype, device=ref.fc1.weight.device)
    with torch.no_grad():
        m.layer_norm_weight.copy_(ref.norm.weight)
        m.layer_norm_bias.copy_(ref.norm.bias)
        m.fc1_weight.copy_(ref.fc1.weight)
        m.fc1_bias.copy_(ref.fc1.bias)
        m.fc2_weight.copy_(ref.fc2.weight)
        m.fc2_bias.copy_(ref.fc2.bias)
    return m


def _eager_step(model, x, dy):
    def step(i):
        model(x).backward(dy)

    return step


def _torch_graphed(model, x, dy):
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    return _eager_step(graphed, x, dy)


def _g8_eager(model, x, dy):
    def step(i):
        with g8.fp8_autocast(recipe=RECIPE):
            y = model(x, is_first_microbatch=i % MICROBATCHES_PER_STEP == 0)
        y.backward(dy)

    return step


def _g8_fp8_weights(ref: TorchMLP) -> g8.LayerNormMLP:
    """The same block with FP8 primary weights (the torch weights quantized)."""
    h = ref.norm.normalized_shape[0]
    with g8.fp8_model_init():
        m = g8.LayerNormMLP(h, 4 * h, params_dtype=ref.fc1.weight.dtype, device="cuda")
    m.load_state_dict(_g8_from_torch(ref).state_dict())
    return m


def _g8_graphed(model, x, dy, recipe=RECIPE):
    graphed = g8.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=recipe,
                                        fp8_weight_caching=True)  # fmt: skip

    def step(i):
        graphed(x, is_first_microbatch=i % MICROBATCHES_PER_STEP == 0).backward(dy)

    return step


def _torchao(model):
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model)


def make_peers(hidden: int, tokens: int, compile_peers: bool, layers: int = 1) -> dict:
    """{name: build()} for every peer on the same weights and inputs (CUDA); build() makes the
    peer's model (and graphs) and returns its step(i), so that one peer at a time holds memory."""
    torch.manual_seed(0)
    ref = TorchMLP(hidden)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    peers = {
        "bf16 eager": lambda: _eager_step(copy.deepcopy(ref), x, dy),
        "bf16 graphed": lambda: _torch_graphed(copy.deepcopy(ref), x, dy),
        "graphfp8 fp8 eager": lambda: _g8_eager(_g8_from_torch(ref), x, dy),
        "graphfp8 fp8 graphed": lambda: _g8_graphed(_g8_from_torch(ref), x, dy),
        # Issue 16: current scaling (an amax pass per cast) and FP8 primary weights (no weight
        # cast, the transpose on the first microbatch of each step), both graphed.
        "graphfp8 fp8 current graphed": lambda: _g8_graphed(_g8_from_torch(ref), x, dy, CURRENT),
        "graphfp8 fp8w graphed": lambda: _g8_graphed(_g8_fp8_weights(ref), x, dy),
    }
    if compile_peers:
        peers["bf16 compile"] = lambda: _eager_step(torch.compile(copy.deepcopy(ref)), x, dy)
    if torchao_available():
        peers["torchao fp8 eager"] = lambda: _eager_step(_torchao(copy.deepcopy(ref)), x, dy)
        if compile_peers:
            peers["torchao fp8 compile"] = lambda: _eager_step(
                torch.compile(_torchao(copy.deepcopy(ref))), x, dy
            )
    if compile_peers:
        # Dynamo graph-breaks around the FP8 layer, which runs eagerly (docs/architecture.md,
        # "torch.compile"): this measures what compiling a graphfp8 block gives without graphs.
        peers["graphfp8 fp8 compile"] = lambda: _g8_eager(torch.compile(_g8_from_torch(ref)), x, dy)
    peers.update(te_block_peers(ref, x, dy, MICROBATCHES_PER_STEP))
    return peers
