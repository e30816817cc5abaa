"""Hugging Face users' benchmark (issue 32): the same ~100M Llama as `bench hf`, trained by
Hugging Face Trainer - the HF model in bf16 against g8.from_hf(recipe=...) in FP8, eager and with
per-layer graphs (graphs="layers"), with no FP8 code in Trainer's loop - and generate() with a KV
cache: HF's in bf16 against graphfp8's layers in bf16 and in FP8. Tokens/s in steady state (the
first steps of each peer are warm-up and capture; a generate call before the timed ones).
Trainer runs its default optimizer (adamw_torch_fused). `python -m benchmarks hf-users`; `bench hf`
runs it too. Needs transformers and accelerate."""

from __future__ import annotations

import time

import torch

import graphfp8 as g8
from benchmarks.common import environment, gpu_busy, print_table, sync
from benchmarks.hf_model import FULL, QUICK, RECIPE, hf_model
from graphfp8.training.data import Dataset
from graphfp8.training.sources import open_stream

# generate(): (prompts, prompt tokens, new tokens, timed calls)
GENERATE_FULL, GENERATE_QUICK = (8, 128, 128, 3), (2, 16, 8, 1)


def _rows(data: Dataset, shape, device) -> list[dict]:
    """Every token row the Trainer runs, input_ids = labels (HF's causal-LM convention)."""
    *_, batch, seq, mbs, steps = shape
    rows = []
    for step in range(steps):
        for mb in range(mbs):
            for r in data.train_batch(step, mb, batch, seq)[:, :-1].to(device):
                rows.append({"input_ids": r, "labels": r})
    return rows


def _trainer_run(model, rows, shape, device) -> dict:
    """Trainer.train over `rows` in order; tokens/s over the steps after the warm-up ones."""
    import transformers

    *_, batch, seq, mbs, steps = shape
    warmup = max(1, steps // 5)
    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            sync(device)
            marks.append(time.perf_counter())

    cuda = torch.device(device).type == "cuda"
    args = transformers.TrainingArguments(
        output_dir="/tmp/graphfp8_bench_trainer", per_device_train_batch_size=batch,
        gradient_accumulation_steps=mbs, max_steps=steps, learning_rate=3e-4,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=not cuda, dataloader_pin_memory=False, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   callbacks=[Clock()])  # fmt: skip
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its final log line
    loss = trainer.train().training_loss
    seconds = marks[-1] - marks[warmup - 1]
    return {"tokens_per_s": batch * seq * mbs * (steps - warmup) / seconds,
            "mean_loss": float(loss)}  # fmt: skip


def trainer_rows(shape, device, data: Dataset) -> dict:
    """Trainer with the HF model in bf16, and with the converted model in FP8 (eager, layer
    graphs): same weights, same rows in the same order."""
    rows = _rows(data, shape, device)
    peers = {
        "Trainer + HF bf16": lambda: hf_model(shape, device),
        "Trainer + graphfp8 FP8 eager": lambda: g8.from_hf(hf_model(shape, device),
                                                           recipe=RECIPE),
        "Trainer + graphfp8 FP8 layer graphs": lambda: g8.from_hf(
            hf_model(shape, device), recipe=RECIPE, graphs="layers"),
    }  # fmt: skip
    out = {}
    for name, build in peers.items():
        out[name] = _trainer_run(build(), rows, shape, device)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return out


def _generate_run(model, prompts, new: int, calls: int, device, profile_new: int) -> dict:
    """New tokens/s of `calls` timed generate() calls; with profile_new, one more call of that
    many new tokens under torch.profiler: kernels per new token and the GPU busy fraction
    (benchmarks/common.py's gpu_busy)."""
    kw = dict(min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompts, max_new_tokens=new, **kw)  # warm-up: allocator, handles, FP8
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            model.generate(prompts, max_new_tokens=new, **kw)
        sync(device)
        out = {"tokens_per_s": prompts.shape[0] * new * calls / (time.perf_counter() - t0)}
        if profile_new:
            kw["min_new_tokens"] = profile_new
            busy = gpu_busy(lambda _: model.generate(prompts, max_new_tokens=profile_new, **kw),
                            1, device)  # fmt: skip
            out.update(kernels_per_new_token=busy["kernels_per_call"] / profile_new,
                       busy_fraction=busy["busy_fraction"])  # fmt: skip
    return out


def generate_rows(shape, device, quick: bool, profile_new: int = 0) -> dict:
    """generate() new tokens/s: HF bf16, graphfp8's layers in bf16 and in FP8 (current scaling:
    no delayed state carries between decode steps' different shapes); with profile_new, kernels
    per new token and GPU busy of one profiled call of that many tokens (gpu_check's step
    `generate`; `bench hf-users` leaves it out)."""
    prompts_n, prompt_len, new, calls = GENERATE_QUICK if quick else GENERATE_FULL
    hf = hf_model(shape, device).eval()
    prompts = torch.randint(1, 256, (prompts_n, prompt_len), device=device,
                            generator=torch.Generator(device).manual_seed(0))  # fmt: skip
    args = (prompts, new, calls, device, profile_new)
    out = {"HF bf16 generate": _generate_run(hf, *args)}
    bf16 = g8.from_hf(hf_model(shape, device)).eval()
    out["graphfp8 bf16 generate"] = _generate_run(bf16, *args)
    fp8 = g8.from_hf(hf_model(shape, device), recipe=g8.Float8CurrentScaling()).eval()
    out["graphfp8 FP8 generate"] = _generate_run(fp8, *args)
    return out


def tables(trainer: dict, generate: dict, title: str) -> str:
    base = trainer["Trainer + HF bf16"]["tokens_per_s"]
    text = print_table(f"Hugging Face Trainer, {title}",
                       ["peer", "tokens/s", "/ Trainer + HF bf16", "mean training loss"],
                       [[n, r["tokens_per_s"], r["tokens_per_s"] / base, r["mean_loss"]]
                        for n, r in trainer.items()])  # fmt: skip
    base = generate["HF bf16 generate"]["tokens_per_s"]
    text += print_table("generate() with a KV cache, greedy", ["peer", "new tokens/s",
                        "/ HF bf16"], [[n, r["tokens_per_s"], r["tokens_per_s"] / base]
                                       for n, r in generate.items()])  # fmt: skip
    return text


def run(device, quick: bool = False) -> dict:
    shape = QUICK if quick else FULL
    data = Dataset(open_stream("stdlib"), val_fraction=0.0)
    trainer = trainer_rows(shape, device, data)
    generate = generate_rows(shape, device, quick)
    text = tables(trainer, generate, f"Llama {shape[:5]}, batch {shape[5]} x seq {shape[6]} x "
                  f"{shape[7]} microbatches, {shape[8]} steps, {device}")  # fmt: skip
    return {"env": environment(device), "shape": list(shape), "trainer": trainer,
            "generate": generate, "table": text}  # fmt: skip
