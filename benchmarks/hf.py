"""Hugging Face Llama benchmark (issue 23): a ~100M-parameter LlamaForCausalLM built from a config
(random weights, byte vocabulary) training on the standard library's text, the untouched HF
model in bf16 (eager, and torch.compile) against graphfp8.from_hf of the same weights in FP8 with
per-decoder-layer graphs and with the whole step as one graph. Tokens/s in steady state (the
first steps of each peer are warm-up, capture and compilation) and the loss each peer reaches;
then the same model under Hugging Face Trainer and generate() (benchmarks/hf_users.py).
Needs `transformers` and `accelerate` (pip install -e .[hf])."""

from __future__ import annotations

import time

import torch

import graphfp8 as g8
from benchmarks import hf_users
from benchmarks.common import environment, print_table, sync
from benchmarks.hf_model import FULL, QUICK, RECIPE, hf_model
from graphfp8.hf import causal_lm_loss
from graphfp8.training.data import Dataset
from graphfp8.training.sources import open_stream


def _adamw(params, device):
    mode = dict(capturable=True) if torch.device(device).type == "cuda" else dict(fused=True)
    return torch.optim.AdamW(params, lr=torch.tensor(3e-4, device=device), **mode)


def _batches(data: Dataset, shape, device, step: int):
    *_, batch, seq, mbs, _ = shape
    tokens = torch.stack([data.train_batch(step, mb, batch, seq) for mb in range(mbs)])
    tokens = tokens.to(device)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def _hf_step(model, opt):
    def step(ids, targets):
        total = 0.0
        for mb in range(ids.shape[0]):
            loss = causal_lm_loss(model(ids[mb]).logits, targets[mb]) / ids.shape[0]
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def _g8_layers_step(lm, opt, shape, device):
    *_, batch, seq, _, _ = shape
    hidden = lm.layers[0].hidden_size
    samples = tuple((torch.randn(batch, seq, hidden, dtype=torch.bfloat16, device=device,
                                 requires_grad=True),) for _ in lm.layers)  # fmt: skip
    g8.make_graphed_callables(tuple(lm.layers), samples, fp8_enabled=True, fp8_recipe=RECIPE,
                              fp8_weight_caching=True)  # fmt: skip

    def step(ids, targets):
        total = 0.0
        for mb in range(ids.shape[0]):
            loss = causal_lm_loss(lm(ids[mb], is_first_microbatch=mb == 0), targets[mb])
            (loss / ids.shape[0]).backward()
            total = total + loss.detach() / ids.shape[0]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def _g8_whole_step(lm, opt, shape, device, data):
    ids, targets = _batches(data, shape, device, 0)
    graphed = g8.make_graphed_step(lm, causal_lm_loss, opt, ((ids,), (targets,)), ids.shape[0],
                                   fp8_enabled=True, fp8_recipe=RECIPE)  # fmt: skip
    return lambda ids, targets: graphed(((ids,), (targets,)))


def _peers(shape, device, data) -> dict:
    def hf_eager():
        model = hf_model(shape, device)
        return _hf_step(model, _adamw(model.parameters(), device))

    def hf_compile():
        model = hf_model(shape, device)
        opt = _adamw(model.parameters(), device)
        return _hf_step(torch.compile(model), opt)

    def g8_layers():
        lm = g8.from_hf(hf_model(shape, device))
        return _g8_layers_step(lm, _adamw(lm.parameters(), device), shape, device)

    def g8_step():
        lm = g8.from_hf(hf_model(shape, device))
        return _g8_whole_step(lm, _adamw(lm.parameters(), device), shape, device, data)

    return {"HF bf16 eager": hf_eager, "HF bf16 compile": hf_compile,
            "graphfp8 FP8 layer graphs": g8_layers, "graphfp8 FP8 step graph": g8_step}  # fmt: skip


def _run_peer(build, shape, device, data) -> dict:
    *_, batch, seq, mbs, steps = shape
    step = build()
    warmup = max(1, steps // 5)
    losses = []
    for s in range(steps):
        if s == warmup:
            sync(device)
            t0 = time.perf_counter()
        losses.append(step(*_batches(data, shape, device, s)))
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = batch * seq * mbs * (steps - warmup)
    return {"tokens_per_s": tokens / seconds, "final_loss": float(losses[-1])}


def run(device, quick: bool = False) -> dict:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("the hf benchmark needs transformers: pip install -e .[hf]") from None
    shape = QUICK if quick else FULL
    data = Dataset(open_stream("stdlib"), val_fraction=0.0)
    rows = {}
    for name, build in _peers(shape, device, data).items():
        if quick and "compile" in name:
            continue  # inductor's first compile alone takes minutes on a CPU
        rows[name] = _run_peer(build, shape, device, data)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    base = rows["HF bf16 eager"]["tokens_per_s"]
    hidden, inter, layers, heads, kv, batch, seq, mbs, steps = shape
    title = (
        f"Llama (h {hidden}, F {inter}, {layers} layers, {heads} heads / {kv} kv), batch "
        f"{batch} x seq {seq} x {mbs} microbatches, {steps} steps on stdlib text, {device}"
    )
    text = print_table(
        title, ["peer", "tokens/s", "/ HF bf16 eager", "loss at the last step"],
        [[n, r["tokens_per_s"], r["tokens_per_s"] / base, r["final_loss"]]
         for n, r in rows.items()],
    )  # fmt: skip
    # Issue 32: the same model trained by HF Trainer, and generate().
    trainer = hf_users.trainer_rows(shape, device, data)
    generate = hf_users.generate_rows(shape, device, quick)
    text += hf_users.tables(trainer, generate, title)
    return {"env": environment(device), "shape": list(shape), "peers": rows, "trainer": trainer,
            "generate": generate, "table": text}  # fmt: skip
