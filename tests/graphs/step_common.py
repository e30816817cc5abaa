"""The eager training step that make_graphed_step must equal bit for bit, a tiny language model
(embedding -> FP8 TransformerLayer -> norm -> head), and comparisons of the whole training state."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import graphfp8 as g8
from graphfp8.distributed import allreduce_gradients
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import fp8_state

VOCAB, H, HEADS, FFN, B, S = 64, 32, 2, 64, 2, 16  # B * S = 32 tokens: a multiple of 16
RECIPE = g8.DelayedScaling(amax_history_len=4)


class TinyLM(nn.Module):
    """tokens (B, S) int64 -> logits (B, S, VOCAB): the whole model is captured, embedding and
    head included."""

    def __init__(self, device="cpu", dtype=torch.bfloat16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H, dtype=dtype, device=device)
        self.block = g8.TransformerLayer(H, HEADS, FFN, max_seq_len=S, params_dtype=dtype,
                                         device=device)  # fmt: skip
        self.norm = nn.LayerNorm(H, dtype=dtype, device=device)
        self.head = g8.Linear(H, VOCAB, bias=False, params_dtype=dtype, device=device)

    def forward(self, tokens, is_first_microbatch=None):
        h = self.block(self.embed(tokens), is_first_microbatch=is_first_microbatch)
        return self.head(self.norm(h), is_first_microbatch=is_first_microbatch)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def lm_batch(n: int, device, seed: int = 0):
    """(tokens, targets), each (n, B, S) int64."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, B, S + 1), generator=gen)
    return data[..., :-1].contiguous().to(device), data[..., 1:].contiguous().to(device)


def adamw(params, device, lr=1e-2, **kw):
    """AdamW as a step graph can capture it: capturable on the GPU, fused on the CPU."""
    mode = dict(capturable=True) if torch.device(device).type == "cuda" else dict(fused=True)
    lr = torch.tensor(lr, device=device)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, **mode, **kw)


def eager_step(model, loss_fn, optimizer, batch, n, *, fp8=True, recipe=RECIPE, caching=True,
               max_grad_norm=None, fp8_group=None, process_group=None):  # fmt: skip
    """The training step as a user writes it. Returns (loss, grad_norm, grads before clipping,
    grads after clipping)."""
    inputs, targets = batch
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    targets = (targets,) if isinstance(targets, torch.Tensor) else targets
    total = torch.zeros((), device=inputs[0].device)
    for i in range(n):
        first = (i == 0) if caching else None
        with g8.fp8_autocast(enabled=fp8, recipe=recipe, fp8_group=fp8_group):
            out = model(*[t[i] for t in inputs], is_first_microbatch=first)
        loss = loss_fn(out, *[t[i] for t in targets]) / n
        loss.backward()
        total += loss.detach()
    if process_group is not None:
        allreduce_gradients(model.parameters(), process_group)
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = None
    if max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    after = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm, before, after


def compare_training_state(eager, graphed, opt_e, opt_g, what: str) -> None:
    """Parameters, buffers, optimizer state, FP8 scales and histories: bit for bit."""
    named = zip(eager.named_parameters(), graphed.named_parameters(), strict=True)
    for (name, pe), (_, pg) in named:
        assert_bitwise_equal(pg, pe, f"{what}: weight {name}")
    for (name, be), (_, bg) in zip(eager.named_buffers(), graphed.named_buffers(), strict=True):
        assert_bitwise_equal(bg, be, f"{what}: buffer {name}")
    params = zip(eager.parameters(), graphed.parameters(), strict=True)
    for i, (pe, pg) in enumerate(params):
        se, sg = opt_e.state.get(pe, {}), opt_g.state.get(pg, {})
        if not se:  # before the first step: the capture left the state torch creates, zeros
            assert all(not v.any() for v in sg.values()), f"{what}: state of parameter {i}"
            continue
        assert sorted(se) == sorted(sg), f"{what}: optimizer state keys of parameter {i}"
        for key in se:
            assert_bitwise_equal(sg[key], se[key], f"{what}: optimizer {key} of parameter {i}")
    fp8_e, fp8_g = fp8_state(eager), fp8_state(graphed)
    if not fp8_e:  # the eager model has not run in FP8 yet: the graphed one holds fresh slots
        for name, t in fp8_g:
            assert torch.equal(t, torch.ones_like(t) if "scale" in name else torch.zeros_like(t))
        return
    for (name, se), (_, sg) in zip(fp8_e, fp8_g, strict=True):
        assert_bitwise_equal(sg, se, f"{what}: {name}")


def compare_step(step, result, what: str) -> None:
    """The graphed step's outputs against eager_step's result."""
    loss, norm, before, after = result
    assert_bitwise_equal(step.loss, loss, f"{what}: loss")
    if norm is None:
        assert step.grad_norm is None
    else:
        assert_bitwise_equal(step.grad_norm, norm, f"{what}: grad norm")
    if step.grads_before_clipping is not None:
        for i, (g, e) in enumerate(zip(step.grads_before_clipping, before, strict=True)):
            assert_bitwise_equal(g, e, f"{what}: grad {i} before clipping")
    for i, (g, e) in enumerate(zip(step.grads, after, strict=True)):
        assert_bitwise_equal(g, e, f"{what}: grad {i} (clipped)")


def tiny_lm_step_graph_equals_eager(device, recipe, n: int = 3, steps: int = 3) -> None:
    """The whole training step of TinyLM (n microbatches, AdamW) under `recipe` as one graph,
    against the eager step: compared after the capture and after every step."""
    eager = TinyLM(device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)
    step = g8.make_graphed_step(model, lm_loss, opt_g, lm_batch(n, device, 99), n,
                                fp8_enabled=True, fp8_recipe=recipe, num_warmup_iters=1,
                                keep_grads_before_clipping=True)  # fmt: skip
    compare_training_state(eager, model, opt_e, opt_g, "after capture")
    for s in range(steps):
        batch = lm_batch(n, device, s)
        result = eager_step(eager, lm_loss, opt_e, batch, n, recipe=recipe)
        step(batch)
        compare_step(step, result, f"step {s}")
        compare_training_state(eager, model, opt_e, opt_g, f"step {s}")
