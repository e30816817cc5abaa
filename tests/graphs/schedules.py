"""A pipeline-parallel schedule run in one process, eagerly and through graphed callables captured
with `order` (TransformerEngine's convention), for the schedule tests and the test matrix.

Chunk c's input for microbatch k is chunk c-1's output, detached (what a pipeline's send/receive
does); each chunk's backward is its own backward pass, fed by the input gradient of the chunk
after it. Eagerly, each chunk forward runs in its own fp8_autocast region.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import fp8_state

# Megatron-LM's interleaved 1F1B with 2 chunks and 3 microbatches:
# f(0,0) f(1,0) f(0,1) f(1,1) b(1,0) b(0,0) f(0,2) f(1,2) b(1,1) b(0,1) b(1,2) b(0,2)
ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def chunks_of(hidden, layers_per_chunk, num_chunks, dtype, device, kind="Linear"):
    def layer():
        if kind == "Linear":
            return g8.Linear(hidden, hidden, params_dtype=dtype, device=device)
        return g8.LayerNormMLP(hidden, 2 * hidden, params_dtype=dtype, device=device)

    return [[layer() for _ in range(layers_per_chunk)] for _ in range(num_chunks)]


def run_schedule(order, call, layers, xs, dys, first_of):
    """Runs `order`; call(c, k, l, x, first) runs layer l (of `layers`) of chunk c on
    microbatch k. Returns the outputs of every chunk forward and the input gradients of chunk 0,
    in run order."""
    num_chunks, count = max(order), {}
    inputs, outputs, record = {}, {}, []
    for entry in order:
        c = abs(entry) - 1
        k = count[entry] = count.get(entry, -1) + 1
        if entry > 0:
            x = xs[k] if c == 0 else outputs[(c - 1, k)].detach()
            inputs[(c, k)] = x = x.clone().requires_grad_()
            h = x
            for ll in range(layers):
                h = call(c, k, ll, h, first_of[k])
            outputs[(c, k)] = h
            record.append(h.detach().clone())
        else:
            dy = dys[k] if c == num_chunks - 1 else inputs[(c + 1, k)].grad
            outputs.pop((c, k)).backward(dy)
            if c == 0:
                record.append(inputs[(c, k)].grad.clone())
    return record


def train_schedule(device, dtype, fp8, layers_per_chunk=1, steps=2, kind="Linear", hidden=16,
                   tokens=16, flags=None):  # fmt: skip
    """Trains the chunks eagerly and graphed with ORDER, asserting bitwise equality of every
    chunk output, input gradient, parameter gradient, weight and FP8 state. flags: FP8 on or
    off per layer (chunk-major; make_graphed_callables' per-callable fp8_enabled), default
    `fp8` for all."""
    num_chunks, mbs = max(ORDER), ORDER.count(1)
    recipe = g8.DelayedScaling(amax_history_len=4)
    eager = chunks_of(hidden, layers_per_chunk, num_chunks, dtype, device, kind)
    graphed_chunks = copy.deepcopy(eager)
    flat = tuple(m for chunk in graphed_chunks for m in chunk)
    kw = dict(dtype=dtype, device=device, requires_grad=True)
    samples = tuple(
        (torch.randn(tokens, hidden, **kw),) for _ in range(num_chunks * mbs * layers_per_chunk)
    )
    enabled = fp8 if flags is None else tuple(flags)
    graphed = g8.make_graphed_callables(flat, samples, fp8_enabled=enabled, fp8_recipe=recipe,
                                        fp8_weight_caching=fp8, order=ORDER)  # fmt: skip
    assert len(graphed) == num_chunks * mbs * layers_per_chunk

    def eager_call(c, k, ll, x, first):
        on = fp8 if flags is None else flags[c * layers_per_chunk + ll]
        with g8.fp8_autocast(enabled=on, recipe=recipe):
            return eager[c][ll](x, is_first_microbatch=first)

    def graphed_call(c, k, ll, x, first):
        return graphed[(c * mbs + k) * layers_per_chunk + ll](x, is_first_microbatch=first)

    first_of = [(k == 0) if fp8 else None for k in range(mbs)]
    opts = [torch.optim.SGD([p for ch in m for lay in ch for p in lay.parameters()], lr=0.1)
            for m in (eager, graphed_chunks)]  # fmt: skip
    for step in range(steps):
        xs = [torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(mbs)]
        dys = [torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(mbs)]
        want = run_schedule(ORDER, eager_call, layers_per_chunk, xs, dys, first_of)
        got = run_schedule(ORDER, graphed_call, layers_per_chunk, xs, dys, first_of)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(a, b, f"step {step}, schedule entry {i}")
        compare_chunks(eager, graphed_chunks, f"step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=False)
        compare_chunks(eager, graphed_chunks, f"after step {step}")


def compare_chunks(eager, graphed, what):
    for c, (ce, cg) in enumerate(zip(eager, graphed, strict=True)):
        for ll, (me, mg) in enumerate(zip(ce, cg, strict=True)):
            where = f"{what}, chunk {c} layer {ll}"
            compare_module(me, mg, where)


def compare_module(me: nn.Module, mg: nn.Module, where: str) -> None:
    pairs = zip(me.named_parameters(), mg.named_parameters(), strict=True)
    for (name, pe), (_, pg) in pairs:
        assert_bitwise_equal(pg, pe, f"{where}: {name}")
        assert (pe.grad is None) == (pg.grad is None), f"{where}: grad of {name}"
        if pe.grad is not None:
            assert_bitwise_equal(pg.grad, pe.grad, f"{where}: grad of {name}")
    for (name, se), (_, sg) in zip(fp8_state(me), fp8_state(mg), strict=True):
        assert_bitwise_equal(sg, se, f"{where}: {name}")
