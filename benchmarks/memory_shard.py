"""Bytes per parameter per GPU, sharded and unsharded (part of `python -m benchmarks memory`):
the persistent training state of a stack of TransformerLayers (graphfp8.memory.training_state,
taken in the second step's optimizer step, after the gradients reached the masters) for bf16
parameters, FP8 with bf16 parameters and FP8 primary weights, each with AdamW as graphfp8-train
runs it, unsharded and with MasterWeights(shard_group=...). Measured at N = 1 (a one-rank group in
this process; on a GPU also torch.cuda.max_memory_allocated); N = 2 and 8 from the sharded
layout of those ranks (graphfp8.memory.sharded_at: the masters' slices and the optimizer's
pieces, the rest replicated)."""

from __future__ import annotations

import contextlib
import gc
import tempfile

import torch
import torch.distributed as dist

import graphfp8 as g8
from benchmarks.common import print_table
from benchmarks.memory_run import RECIPE, Shape, Stack, release
from graphfp8.memory import STATE_CATEGORIES, sharded_at, training_state

__all__ = ["CONFIGS", "one_rank_group", "run", "state_in_optimizer_step"]

# name: (precision, FP8 primary weights, sharded)
CONFIGS = {
    "bf16": ("bf16", False, False),
    "fp8, bf16 params": ("fp8", False, False),
    "fp8, FP8 weights": ("fp8", True, False),
    "bf16, sharded": ("bf16", False, True),
    "fp8, bf16 params, sharded": ("fp8", False, True),
    "fp8, FP8 weights, sharded": ("fp8", True, True),
}
WORLDS = (1, 2, 8)


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A process group of this process alone (in a default group of one, started and ended here
    when there is none)."""
    started = not dist.is_initialized()
    if started:
        if device.type == "cuda":  # NCCL wants the device, with its index
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                                  else device.index)  # fmt: skip
            torch.cuda.set_device(device)
        store = dist.FileStore(tempfile.mkstemp(prefix="graphfp8_bench_")[1], 1)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                device_id=device if device.type == "cuda" else None)  # fmt: skip
    try:
        yield dist.new_group([dist.get_rank()])
    finally:
        if started:
            gc.collect()  # the masters that hold the group
            dist.destroy_process_group()


def _measure(shape: Shape, config: tuple, device: torch.device, group) -> dict:
    """One step, then a forward, a backward and the gradients into the masters: the state in
    the optimizer step (gradients, masters' gradients and optimizer state all alive)."""
    precision, fp8_weights, sharded = config
    g8.reset_state()
    torch.manual_seed(0)
    with g8.fp8_model_init(enabled=fp8_weights):
        model = Stack(shape, device)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, dtype=torch.bfloat16, device=device)

    def forward_backward(model):
        with g8.fp8_autocast(enabled=precision == "fp8", recipe=RECIPE):
            y = model(x, is_first_microbatch=True)
        y.float().square().mean().backward()
        return y

    state, masters = state_in_optimizer_step(model, forward_backward, fp8_weights,
                                             group if sharded else None, device)  # fmt: skip
    out = {"state": {1: state.to_dict()}}
    if sharded:
        for world in WORLDS[1:]:
            out["state"][world] = sharded_at(state, masters, world).to_dict()
    if device.type == "cuda":
        out["max_allocated"] = torch.cuda.max_memory_allocated(device)
    del model, masters
    release(device)
    return out


def state_in_optimizer_step(model, forward_backward, fp8_weights: bool, group, device="cpu"):
    """(training_state, masters) of `model` trained as graphfp8-train runs it - AdamW, through
    MasterWeights when sharded over `group` (not None) or with FP8 primary weights - taken in
    the second step's optimizer step: one step, then forward_backward(model) again and its gradients
    into the masters (gradients, masters' gradients and optimizer state all alive). What
    forward_backward returns stays alive until the state is taken."""
    masters = None
    if group is not None:
        masters = g8.MasterWeights(model, shard_group=group)
    elif fp8_weights:
        masters = g8.MasterWeights(model)
    params = masters.parameters() if masters is not None else model.parameters()
    opt = torch.optim.AdamW(params, lr=torch.tensor(1e-6, device=device), fused=True)
    for step in range(2):
        kept = forward_backward(model)
        if step == 1:
            if masters is not None:  # unsharded: moved into fp32; sharded: reduce-scattered
                masters.copy_grads_()
            break
        if masters is not None:
            masters.step(opt)
            masters.zero_grad()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
    state = training_state(model, opt, masters)
    del kept
    return state, masters


def run(device, quick: bool = False) -> dict:
    """{"shape", "configs": {name: {"state": {N: TrainingState.to_dict()}, "max_allocated"}},
    "table"}."""
    device = torch.device(device)
    shape = Shape(64, layers=2, batch=2, seq=32, heads=2) if quick else Shape(2048, batch=1)
    with one_rank_group(device) as group:
        configs = {name: _measure(shape, config, device, group) for name, config in CONFIGS.items()}
    rows = []
    for name, result in configs.items():
        per = [result["state"].get(n, result["state"][1])["bytes_per_parameter"] for n in WORLDS]
        parts = ", ".join(f"{k} {per[0][k]:.2f}" for k in STATE_CATEGORIES if per[0][k])
        peak = result.get("max_allocated")
        rows.append([name, *[f"{p['total']:.2f}" for p in per], parts,
                     f"{peak / 2**30:.3f}" if peak else "-"])  # fmt: skip
    title = (f"bytes per parameter per GPU (persistent training state), {shape.layers} "
             f"TransformerLayers, hidden {shape.hidden}; N = 1 measured, 2 and 8 from the "
             "sharded layout")  # fmt: skip
    header = ["config", *[f"N={n}" for n in WORLDS], "N=1 by category", "max_allocated GiB"]
    table = print_table(title, header, rows)
    return {"shape": vars(shape), "configs": configs, "table": table}
