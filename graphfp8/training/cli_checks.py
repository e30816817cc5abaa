"""graphfp8-train's checks across options, before anything runs: the number types, the device, the
FP8 options, the compiled baseline's runs, the model's shape (--heads) and whether FP8 attention
runs at that shape on this device."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import torch

from graphfp8.fp8.recipe import DelayedScaling, Format
from graphfp8.modules._attention import prepare_attention
from graphfp8.training.fsdp import REFUSED
from graphfp8.training.presets import BYTE_VOCAB, PRESETS, ModelConfig

__all__ = [
    "bf16_layer_indices",
    "check_compiled_runs",
    "check_device",
    "check_fp8_options",
    "check_model",
    "fraction",
    "model_config",
    "positive",
]


def check_fp8_options(p: argparse.ArgumentParser, args, argv: list[str]) -> None:
    """FP8 options given for runs that do not use them, and settings no run can combine."""
    options = (
        "--fp8-weights",
        "--scaling",
        "--fp8-format",
        "--amax-history-len",
        "--fp8-attention",
        "--fp8-stats",  # with no FP8 run it wrote nothing and said nothing (issue 32, item 7)
        "--bf16-layers",
    )
    given = [o for o in options if any(a == o or a.startswith(o + "=") for a in argv)]
    if given and all(precision != "fp8" for precision, _ in args.runs):
        p.error(f"{', '.join(given)}: no run trains in FP8 (--precision fp8, or fp8 in --compare)")
    if args.scaling != "delayed" and "--amax-history-len" in given:
        p.error(f"--amax-history-len is for delayed scaling: --scaling {args.scaling} keeps no "
                "history")  # fmt: skip
    if args.fp8_attention and args.scaling != "delayed":
        p.error("--fp8-attention needs --scaling delayed: FP8 attention is DelayedScaling only")
    if args.scaling == "blockwise":
        _check_blockwise(p, args, given)
    if args.compile and any(mode == "step" for _, mode in args.runs):
        p.error("--compile with --graphs step: the step graph holds the embedding and the loss "
                "that --compile would take; use --graphs layers or none")  # fmt: skip
    if args.bf16_layers and args.fp8_weights:
        p.error("--bf16-layers with --fp8-weights: an FP8 primary weight has no bf16 copy")
    try:
        args.bf16_layers = bf16_layer_indices(args.bf16_layers, PRESETS[args.preset].layers)
    except ValueError as exc:
        p.error(f"--bf16-layers {args.bf16_layers}: {exc}")


def bf16_layer_indices(text: str, layers: int) -> tuple[int, ...]:
    """--bf16-layers: "first", "last", block indices, comma-separated -> sorted indices."""
    out = set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        index = {"first": 0, "last": layers - 1}.get(item)
        if index is None:
            if not item.isdigit():
                raise ValueError(f"expected first, last or a block index, got {item!r}")
            index = int(item)
        if not 0 <= index < layers:
            raise ValueError(f"the model has blocks 0 to {layers - 1}, got {index}")
        out.add(index)
    return tuple(sorted(out))


def _check_blockwise(p: argparse.ArgumentParser, args, given: list[str]) -> None:
    """--scaling blockwise (Float8BlockScaling) is E4M3 everywhere; its FP8 weights
    (--fp8-weights) are stored in 128x128 blocks, its --fp8-stats are per block."""
    if "--fp8-format" in given and args.fp8_format != "E4M3":
        p.error("--scaling blockwise is E4M3 everywhere: drop --fp8-format or give E4M3")
    if args.fp8_weights and getattr(args, "fsdp", False):
        p.error(
            "--fp8-weights with --scaling blockwise under --fsdp is not supported (torch "
            "FSDP2 of 128x128-block FP8 weights): use --shard"
        )


def positive(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def check_compiled_runs(p: argparse.ArgumentParser, args, runs) -> None:
    """The compiled plain-torch baseline trains bf16 whole rows, unsharded."""
    if not any(mode == "compile" for _, mode in runs):
        return
    if any(precision != "bf16" for precision, mode in runs if mode == "compile"):
        p.error("compile is the plain-torch bf16 baseline: bf16:compile (FP8 runs use graphfp8's "
                "layers: fp8:graphs, fp8:step, fp8:eager)")  # fmt: skip
    if args.pack or args.shard:
        p.error("bf16:compile attends over whole rows, unsharded: leave out --pack and --shard")


def check_device(p: argparse.ArgumentParser, device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        p.error(f"--device {device}: graphfp8-train runs on cpu or cuda[:N]")
    if kind == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU (this torch build: "
                f"{torch.__version__}); use --device cpu")  # fmt: skip


def model_config(args, vocab: int) -> ModelConfig:
    """The preset with the command line's --batch, --seq-len, --heads and --layers, and the data's
    vocabulary `vocab`; a preset with a vocabulary of its own (llama-1b, llama-8b: Llama 3's)
    keeps it when the data's is smaller (the model then has Llama's head, the data uses its first
    `vocab` ids)."""
    overrides = {k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len),
                                   ("heads", args.heads),
                                   ("layers", getattr(args, "layers", None))) if v}  # fmt: skip
    preset = PRESETS[args.preset]
    if preset.vocab != BYTE_VOCAB:
        vocab = max(vocab, preset.vocab)
    return dataclasses.replace(preset, vocab=vocab, **overrides)


def check_model(p: argparse.ArgumentParser, args) -> None:
    """--recompute against --compile --no-graphs, --heads against the preset's width and
    key/value heads, and --fp8-attention against what FP8 attention runs (on the GPU cuDNN's
    graphs are built now: its refusal is the error; with --deterministic it is refused:
    graphfp8.ops.cudnn_determinism)."""
    if args.recompute != "none" and args.compile and any(g == "none" for _, g in args.runs):
        p.error(
            "--recompute with --compile --no-graphs: dynamo cannot trace graphfp8's "
            "recompute; keep the graphs (--compile then compiles around them)"
        )
    cfg = model_config(args, 256)
    kv = cfg.kv_heads or cfg.heads
    if cfg.hidden % cfg.heads or (cfg.hidden // cfg.heads) % 2 or cfg.heads % kv:
        p.error(f"--heads {cfg.heads}: the {args.preset} preset needs heads dividing its width "
                f"{cfg.hidden} into an even head_dim, and a multiple of its {kv} key/value "
                "heads")  # fmt: skip
    if not args.fp8_attention or all(precision != "fp8" for precision, _ in args.runs):
        return
    d = cfg.hidden // cfg.heads
    recipe = DelayedScaling(fp8_format=Format[args.fp8_format], fp8_dpa=True, fp8_mha=True)
    try:
        prepare_attention((cfg.batch, cfg.seq_len, cfg.heads, d), (cfg.batch, cfg.seq_len, kv, d),
                          args.device, recipe, 1.0 / math.sqrt(d), True, True,
                          deterministic=args.deterministic)  # fmt: skip
    except RuntimeError as exc:  # --deterministic (graphfp8.ops.cudnn_determinism)
        p.error(f"--deterministic --fp8-attention: {exc}")
    except (ValueError, ImportError) as exc:
        hint = ""
        if torch.device(args.device).type == "cuda" and d != 128 and cfg.hidden % 128 == 0:
            hint = (f" (on Hopper cuDNN's FP8 attention backward takes head_dim 128 only; "
                    f"--heads {cfg.hidden // 128} gives it)")  # fmt: skip
        p.error(f"--fp8-attention: {exc}{hint}")


def check_fsdp(p: argparse.ArgumentParser, args: argparse.Namespace, modes: set[str]) -> None:
    """--fsdp's refusals (training/fsdp.py's REFUSED), before anything starts; `modes`: the graph
    modes of the runs."""
    if args.hsdp > 1 and not args.fsdp:
        p.error("--hsdp replicates FSDP2's shards: use it with --ddp --fsdp")
    if args.fsdp_sync != "every" and not args.fsdp:
        p.error("--fsdp-sync is FSDP2's gradient sync: use it with --ddp --fsdp")
    if args.fsdp_prefetch and not args.fsdp:
        p.error("--fsdp-prefetch is FSDP2's explicit prefetch: use it with --ddp --fsdp")
    if not args.fsdp:
        return
    if not args.ddp:
        p.error("--fsdp shards over the ranks of --ddp: torchrun --nproc_per_node=N -m "
                "graphfp8.training --ddp --fsdp --graphs none")  # fmt: skip
    used = {"graphs": "compile" in modes, "shard": args.shard,
            "save": args.save is not None or args.resume is not None,
            "check_replicas": args.check_replicas, "compile": args.compile}  # fmt: skip
    for key, on in used.items():
        if on:
            p.error(f"--fsdp: {REFUSED[key]}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.hsdp:
        p.error(f"--hsdp {args.hsdp}: the replicas must divide the {world} ranks (each replica "
                f"FSDP2-shards over world / replicas of them)")  # fmt: skip


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """--ddp and how it shards (--shard, --fsdp) and checks (--check-replicas)."""
    p.add_argument("--ddp", action="store_true", help="data parallel over torchrun's processes")
    p.add_argument("--collective-timeout-s", type=positive, default=600, metavar="S",
                   help="with --ddp: a collective waiting longer (a hung rank) fails every rank "
                   "instead of hanging (init_process_group's timeout) (default: 600)")  # fmt: skip
    p.add_argument("--shard", action="store_true", help="with --ddp: fp32 masters of every "
                   "parameter, gradients and optimizer state sharded over the ranks "
                   "(MasterWeights(shard_group=...), docs/sharding.md) (default: off)")  # fmt: skip
    p.add_argument("--fsdp", action="store_true", help="with --ddp --graphs none, layers or step: "
                   "the weights sharded too, by torch FSDP2 (docs/sharding.md) "
                   "(default: off)")  # fmt: skip
    p.add_argument("--hsdp", type=positive, default=1, metavar="R",
                   help="with --fsdp: R replicas, each FSDP2-sharding the weights over N / R "
                   "ranks (HSDP: a 2-D (R, N / R) mesh; gradients all-reduced across the "
                   "replicas) (default: 1, plain FSDP2)")  # fmt: skip
    p.add_argument("--fsdp-sync", choices=("every", "last"), default="every",
                   help="with --fsdp: FSDP2 reduce-scatters the gradients after every "
                   "microbatch, or only after the last (gradient accumulation without "
                   "communication: the weights stay gathered and the unsharded gradients "
                   "accumulate between microbatches; more memory, other summation order; "
                   "docs/sharding.md) (default: every)")  # fmt: skip
    p.add_argument("--fsdp-prefetch", action="store_true",
                   help="with --fsdp: FSDP2's explicit prefetch, each layer all-gathering the "
                   "next one's weights before its forward compute and the previous one's before "
                   "its backward (set_modules_to_forward_prefetch / ..._backward_prefetch), in "
                   "every graph mode (docs/sharding.md) (default: off)")  # fmt: skip
    p.add_argument("--check-replicas", action="store_true",
                   help="with --ddp: the ranks' weights compared (digests of their bits) after "
                   "every step; a difference stops every rank with exit status 3 "
                   "(distributed/replica_check.py) (default: off)")  # fmt: skip
