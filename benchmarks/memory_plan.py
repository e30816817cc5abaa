"""The memory planner (graphfp8/memory/plan.py) against graphfp8-train on one GPU: runs of a model
of Llama-3-8B layers (h 4096, 32/8 heads, SwiGLU 14336, vocab 128256; 4 layers, so that every
setting fits one H200 unsharded) at B1 x S8192, each trained for 3 steps, torch.cuda's peak
allocated bytes (summary.json's max_allocated_bytes) against the planned peak, as a ratio
(target: within 10%), and torch.cuda's peak reserved bytes against the planned footprint (the
peak with the graphs' pools held; reserved also holds the allocator's cache). On the CPU (--quick:
a tiny model) the peak is cpu_peak's: LiveBytes over the whole run, the graphs allocating as CUDA
graphs do (tests/test_memory_plan.py checks every setting against it)."""

from __future__ import annotations

import dataclasses
import gc
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

import graphfp8 as g8
from benchmarks.common import environment, print_table
from benchmarks.memory_shard import one_rank_group
from graphfp8.graphs.backends import tapes_allocate_as_cuda
from graphfp8.memory import AllocatedBytes, LiveBytes
from graphfp8.memory.plan import plan
from graphfp8.memory.shapes import LLAMA, shape_from
from graphfp8.training.data import Dataset
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS, ModelConfig
from graphfp8.training.run import RunSpec
from graphfp8.training.sources import open_stream, token_dtype

# (FP8 weights, recompute, graphs, sharding)
SETTINGS = [
    (False, "none", "layers", "ddp"),
    (False, "full", "layers", "ddp"),
    (True, "selective", "step", "ddp"),
    (True, "full", "none", "ddp"),
    (False, "full", "none", "fsdp2"),  # graphfp8-train --fsdp on a one-rank group
    (True, "full", "none", "fsdp2"),
]


def _config(quick: bool) -> ModelConfig:
    if quick:
        return dataclasses.replace(PRESETS["llama-tiny"], batch=2, seq_len=32)
    s = LLAMA["llama-8b"]
    return ModelConfig(hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, ffn=s.ffn, layers=4,
                       seq_len=8192, batch=1, lr=1e-4, vocab=s.vocab, activation=s.activation,
                       norm=s.norm, bias=s.bias)  # fmt: skip


def _tokens(tmp: Path, vocab: int, count: int) -> Dataset:
    """A .bin file of random token ids below vocab, in the element type open_stream reads for it
    (uint16 up to 65536 tokens, uint32 for Llama 3's 128256: docs/training.md)."""
    path = tmp / "tokens.bin"
    ids = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(0))
    ids.to(token_dtype(vocab)).numpy().tofile(path)
    return Dataset(open_stream(str(path), vocab_size=vocab), val_fraction=0.05)


def fresh_sharding_propagation() -> None:
    """Empties DTensor's sharding-propagation caches, as in a fresh process: an op over DTensors
    runs its propagation (the op on fake tensors of the global shapes) only on a cache miss, so a
    run measured after another of the same shapes would not see what a first step costs
    (docs/sharding.md, "The first optimizer step under FSDP2")."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    FakeTensorMode.cache_clear()


def cpu_peak(spec: RunSpec, data: Dataset, out: Path, steps: int = 2, group=None) -> int:
    """The peak bytes graphfp8-train allocates for `spec` on the CPU: LiveBytes over the whole run
    (model, masters, captures, steps, validation), CPU tapes allocating as CUDA graphs do
    (graphs.backends.tapes_allocate_as_cuda): the CPU's torch.cuda.max_memory_allocated. group:
    the run's process group (spec.shard, spec.fsdp). FSDP2 runs count the CPU allocator's bytes
    (AllocatedBytes): LiveBytes sees neither DTensors' local shards nor FSDP2's storage resizes."""
    g8.reset_state()
    gc.collect()
    with tapes_allocate_as_cuda(), AllocatedBytes() if spec.fsdp else LiveBytes() as live:
        train_run(spec, RunOptions(steps=steps, out=out, data=data, val_batches=1,
                                   eval_every=100, group=group))  # fmt: skip
    return live.peak


def run(device, quick: bool = False) -> dict:
    device = str(device)
    cfg = _config(quick)
    shape = shape_from(cfg)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        data = _tokens(Path(tmp), cfg.vocab, 64 * cfg.seq_len)
        for fp8_weights, recompute, graphs, sharding in SETTINGS:
            planned = plan(shape, seq=cfg.seq_len, batch=cfg.batch, recompute=recompute,
                           fp8_weights=fp8_weights, graphs=graphs, sharding=sharding)  # fmt: skip
            measured = reserved = None
            fsdp = sharding == "fsdp2"
            spec = RunSpec("llama-8b-width", cfg, "fp8", graphs, microbatches=2, device=device,
                           fp8_weights=fp8_weights, recompute=recompute, fsdp=fsdp)  # fmt: skip
            if device.startswith("cuda"):
                g8.reset_state()
                with one_rank_group(torch.device(device)) if fsdp else nullcontext() as group:
                    out = train_run(spec, RunOptions(steps=3, out=Path(tmp), data=data,
                                                     val_batches=1, eval_every=100,
                                                     group=group))  # fmt: skip
                measured = out["memory_per_rank"][0]["max_allocated_bytes"]
                reserved = out["peak_reserved_bytes"]
                del out
                gc.collect()
                torch.cuda.empty_cache()
            elif quick:
                with one_rank_group(torch.device(device)) if fsdp else nullcontext() as group:
                    measured = cpu_peak(spec, data, Path(tmp), group=group)
            ratio = planned.peak / measured if measured else None
            results.append({"fp8_weights": fp8_weights, "recompute": recompute, "graphs": graphs,
                            "sharding": sharding,
                            "plan": planned.to_dict(), "measured_peak": measured,
                            "planned_over_measured": ratio, "peak_reserved": reserved,
                            "footprint_over_reserved": reserved and planned.footprint / reserved,
                            })  # fmt: skip
            mode = graphs + (" fsdp2" if fsdp else "")
            rows.append([str(fp8_weights), recompute, mode, f"{planned.peak / 2**30:.2f}",
                         f"{measured / 2**30:.2f}" if measured else "-",
                         f"{ratio:.3f}" if ratio else "-",
                         f"{planned.footprint / 2**30:.2f}",
                         f"{reserved / 2**30:.2f}" if reserved else "-"])  # fmt: skip
    title = (f"memory planner vs graphfp8-train, {cfg.layers} layers h {cfg.hidden} F {cfg.ffn} "
             f"vocab {cfg.vocab}, {cfg.batch} x {cfg.seq_len} tokens, N=1 (target: ratio "
             "within 0.9-1.1)")  # fmt: skip
    header = ["FP8 weights", "recompute", "graphs", "planned GiB", "measured GiB", "plan/meas",
              "footprint GiB", "reserved GiB"]  # fmt: skip
    table = print_table(title, header, rows)
    return {"env": environment(device), "results": results, "table": table}
