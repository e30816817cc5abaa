"""FSDP2 with FP8 primary weights: each rank's persistent training state in bytes per parameter at
N gloo ranks (`python -m benchmarks.memory_fsdp [--worlds 2 3 4] [--hidden H] [--layers L]`).

A stack of TransformerLayers built inside fp8_model_init, fully_shard per layer and at the root
(FSDP2's default reshard_after_forward=True), FSDPMasterWeights and fused AdamW; measured with
graphfp8.memory.training_state (DTensors: this rank's shard) in the second step, after
masters.step and before zero_grad, when the gradients, the masters' gradients and the moments
all exist. Beside it: the bytes of gathered weights still held then (0: every layer resharded),
and one layer's working set while it is gathered (its FP8 weights and their transposes, 2 bytes
per parameter of the layer). The target (docs/sharding.md, "FSDP2"): at most 20 / N plus one
layer's working set.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import graphfp8 as g8
from benchmarks.common import print_table
from benchmarks.memory_run import RECIPE, Shape, Stack
from graphfp8.memory import STATE_CATEGORIES, training_state

__all__ = ["measure", "run"]


def _gathered_bytes(model) -> int:
    """Bytes of FSDP2's all-gather outputs that hold storage now (gathered weights)."""
    total = 0
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        for p in group.fsdp_params if group else ():
            for t in getattr(p, "_unsharded_inner_tensors", None) or p.all_gather_outputs:
                total += t.untyped_storage().nbytes()
    return total


def _rank(rank: int, world: int, store: str, shape: Shape, results) -> None:
    """One rank: build, shard, train 2 steps, report the state (rank 0 of a task's results)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        with g8.fp8_model_init():
            model = Stack(shape, "cpu")
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        masters = g8.MasterWeights(model)
        opt = torch.optim.AdamW(masters.parameters(), lr=1e-4, fused=True)
        gen = torch.Generator().manual_seed(rank)
        for step in range(2):
            x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=gen)
            with g8.fp8_autocast(recipe=RECIPE, fp8_group=dist.group.WORLD):
                y = model(x.to(torch.bfloat16), is_first_microbatch=True)
            y.float().square().mean().backward()
            masters.step(opt)
            if step == 1:
                state = training_state(model, opt, masters)
                gathered = _gathered_bytes(model)
            masters.zero_grad()
        layer_params = sum(p.numel() for p in model.layers[0].parameters())
        results.put((rank, state.per_parameter(), gathered / state.parameters,
                     2 * layer_params / state.parameters))  # fmt: skip
    finally:
        dist.destroy_process_group()


def measure(world: int, shape: Shape) -> dict:
    """{rank: (bytes per parameter by category and "total", gathered at rest, one layer's
    working set)} of a run at `world` gloo ranks."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="graphfp8_fsdp_memory_") + "/store"
    procs = [ctx.Process(target=_rank, args=(r, world, store, shape, results))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    out = {}
    for _ in range(world):
        rank, per_param, gathered, layer = results.get(timeout=600)
        out[rank] = (per_param, gathered, layer)
    for p in procs:
        p.join()
    return out


def run(worlds=(2, 3, 4), shape: Shape | None = None) -> dict:
    """Measures every N; prints one row per N (the rank holding the most) and returns them."""
    shape = shape or Shape(hidden=256, layers=4, batch=1, seq=64)
    rows, result = [], {}
    for world in worlds:
        ranks = measure(world, shape)
        per_param, gathered, layer = max(ranks.values(), key=lambda r: r[0]["total"])
        target = 20 / world + layer
        result[world] = {"bytes_per_parameter": per_param, "gathered_at_rest": gathered,
                         "one_layer_working_set": layer, "target": target}  # fmt: skip
        met = "yes" if per_param["total"] <= target else "NO"
        rows.append([world, *(round(per_param[c], 3) for c in STATE_CATEGORIES),
                     round(per_param["total"], 3), round(gathered, 3), round(layer, 3),
                     round(target, 3), met])  # fmt: skip
    print_table(
        f"FSDP2 + FP8 weights, bytes per parameter on the rank holding the most ({shape})",
        ["N", *STATE_CATEGORIES, "total", "gathered at rest", "one layer's working set",
         "target 20/N + layer", "met"],
        rows,
    )  # fmt: skip
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_fsdp", description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    run(tuple(args.worlds), Shape(hidden=args.hidden, layers=args.layers, batch=1, seq=64))


if __name__ == "__main__":
    main()
