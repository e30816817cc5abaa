"""The sharded peers of graphfp8's `--ddp --shard` (issue 34): graphfp8-train's GPT shapes
(graphfp8/training/torch_model.py) under torch FSDP2 as torchtitan sets it up - fully_shard per
block and at the root, MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) over fp32
parameters, each block torch.compile'd before it is sharded - in bf16, and with torchao's float8
training (convert_to_float8_training, Float8LinearConfig(enable_fsdp_float8_all_gather=True), the
head left in bf16, precompute_float8_dynamic_scale_for_fsdp after each optimizer step). The same
data as graphfp8-train (each rank its rows of every global batch), the same microbatches, fused
AdamW, clipping to 1.0; tokens/s and peak memory per GPU.

    torchrun --nproc_per_node N -m benchmarks.fsdp_peers --presets 100m --json peers.json

FSDP2 reduce-scatters every microbatch's gradients (torchtitan's default with gradient
accumulation), where graphfp8 reduce-scatters once per step.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from benchmarks.common import gpu_busy, sync
from graphfp8.distributed import gather_objects
from graphfp8.training.data import Dataset, split_windows
from graphfp8.training.model import PRESETS, ModelConfig
from graphfp8.training.sources import open_stream
from graphfp8.training.torch_model import TorchGPT

__all__ = ["PEERS", "measure_peer", "torchao_skip_reason", "main"]

PEERS = ("fsdp2-bf16", "torchao-fp8")


def torchao_skip_reason(device: torch.device) -> str | None:
    """Why the torchao peer cannot run here, or None."""
    if device.type != "cuda":
        return "torchao's float8 training needs a CUDA GPU with FP8 (sm_89+)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"torchao's float8 training needs sm_89+, this GPU is sm_{major}{minor}"
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no peer
        return f"torchao does not import: {type(exc).__name__}: {exc}"
    return None


def _build(peer: str, cfg: ModelConfig, device: torch.device, compile_blocks: bool, seed: int):
    """The peer's model, float8-converted (torchao), compiled per block and fully sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)  # the same weights on every rank before sharding
    model = TorchGPT(cfg, torch.float32, device)
    if peer == "torchao-fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda m, fqn: fqn != "head")  # fmt: skip
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        if compile_blocks:
            block = torch.compile(block, fullgraph=True)
            model.blocks[i] = block
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _step(model, opt, data: Dataset, cfg: ModelConfig, step: int, microbatches: int, device,
          precompute: bool) -> torch.Tensor:  # fmt: skip
    """One optimizer step over `microbatches` microbatches of this rank's rows. Returns the
    step's mean loss (a device tensor, not synchronised)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros((), device=device)
    for mb in range(microbatches):
        tokens = data.train_batch(step, mb, cfg.batch, cfg.seq_len, 0, rank, world).to(device)
        inputs, targets, _ = split_windows(tokens)
        loss = model(inputs, targets) / microbatches
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if precompute:  # torchao: every float8 weight's scale in one all-reduce, for the all-gather
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
    return total


def measure_peer(peer: str, cfg: ModelConfig, data: Dataset, device: torch.device, *,
                 steps: int, warmup: int, microbatches: int, compile_blocks: bool,
                 seed: int = 0, profile_steps: int = 0) -> dict:  # fmt: skip
    """Builds the peer, trains `warmup` steps (compilation), `steps` timed ones, then
    `profile_steps` under torch.profiler.

    Returns:
        {"peer", "tokens_per_s" (all ranks), "losses", "build_s", "warmup_s",
        "max_allocated_bytes" (per rank; None on the CPU), "ms_per_step", "host_ms_per_step"
        (until the timed steps were enqueued), "profile" (with profile_steps: benchmarks/common.py's
        gpu_busy: kernels per step, GPU busy fraction)} or
        {"peer", "skipped": reason}.
    """
    if peer == "torchao-fp8" and (reason := torchao_skip_reason(device)) is not None:
        return {"peer": peer, "skipped": reason}
    cuda = device.type == "cuda"
    torch._dynamo.reset()  # the previous peer's compiled blocks hold its modules
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = _build(peer, cfg, device, compile_blocks, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=cuda)  # fmt: skip
    t1 = time.perf_counter()
    args = (model, opt, data, cfg)
    losses = [_step(*args, s, microbatches, device, peer == "torchao-fp8") for s in range(warmup)]
    sync(device)
    t2 = time.perf_counter()
    losses += [_step(*args, warmup + s, microbatches, device, peer == "torchao-fp8")
               for s in range(steps)]  # fmt: skip
    t_enqueued = time.perf_counter()
    sync(device)
    t3 = time.perf_counter()
    tokens = steps * microbatches * cfg.batch * cfg.seq_len * dist.get_world_size()
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    every = gather_objects(peak)
    result = {"peer": peer, "tokens_per_s": tokens / (t3 - t2),
              "losses": [float(x) for x in torch.stack(losses).tolist()],
              "build_s": round(t1 - t0, 2), "warmup_s": round(t2 - t1, 2),
              "max_allocated_bytes": every, "ms_per_step": 1e3 * (t3 - t2) / steps,
              "host_ms_per_step": 1e3 * (t_enqueued - t2) / steps}  # fmt: skip
    if profile_steps:
        first = warmup + steps
        result["profile"] = gpu_busy(
            lambda s: _step(*args, first + s, microbatches, device, peer == "torchao-fp8"),
            profile_steps, device)  # fmt: skip
    return result


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.fsdp_peers")
    p.add_argument("--presets", default="100m", help="comma-separated graphfp8-train presets")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated of {PEERS}")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, help="sequences per microbatch (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="(default: the preset's)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=2,
        help="steps under torch.profiler after the timed ones: GPU busy (0: none)",
    )
    p.add_argument("--data", default="synthetic", help="as graphfp8-train's --data")
    p.add_argument("--json", help="write the results here (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from graphfp8.distributed import cleanup, init_distributed

    args = _parse(argv)
    info = init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    data = Dataset(open_stream(args.data, None, 4 << 20, 0), val_fraction=0.0)
    results = []
    for preset in args.presets.split(","):
        cfg = replace(PRESETS[preset], vocab=data.vocab_size)
        cfg = replace(cfg, batch=args.batch or cfg.batch, seq_len=args.seq_len or cfg.seq_len)
        for peer in args.peers.split(","):
            try:
                r = measure_peer(peer, cfg, data, info.device, steps=args.steps,
                                 warmup=args.warmup, microbatches=args.microbatches,
                                 compile_blocks=args.compile,
                                 profile_steps=args.profile_steps)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - one peer's failure is a result, not the end
                r = {"peer": peer, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            results.append({"preset": preset, "world": info.world_size, **r})
            if info.rank == 0:
                print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}),
                      flush=True)  # fmt: skip
    if info.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world": info.world_size, "torch": torch.__version__, "runs": results}, f,
                      indent=1)  # fmt: skip
    cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
