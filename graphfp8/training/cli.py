"""The main job: train a small GPT of graphfp8.TransformerLayers on real text, with validation.

    graphfp8-train                                # FP8 + graphs on the Python standard library
    graphfp8-train --data notes.txt               # a text file or folder, read as bytes
    graphfp8-train --data train.bin --vocab-size 50304   # nanoGPT's uint16 token file
    graphfp8-train --precision bf16 --no-graphs --steps 200
    graphfp8-train --graphs step                  # the whole training step as one graph
    graphfp8-train --compare                      # bf16 and fp8 side by side, loss plot
    graphfp8-train --compare bf16:eager,bf16:graphs,fp8:graphs --preset 100m
    graphfp8-train --compare bf16:compile,bf16:graphs,fp8:graphs --preset llama-8b --layers 2
    graphfp8-train --compare fp8:layers,fp8:step --preset small
    graphfp8-train --steps 300 --stop-at 100 --save ckpt.pt   # then: ... --resume ckpt.pt
    graphfp8-train --compile                      # torch.compile around the graphed blocks
    graphfp8-train --preset llama-100m --pack     # Llama blocks on packed documents
    graphfp8-train --heads 8 --fp8-attention      # FP8 attention (head_dim 128 on Hopper)
    graphfp8-train --deterministic                # the same bits run to run
    torchrun --nproc_per_node=2 -m graphfp8.training --ddp
    torchrun --nproc_per_node=8 -m graphfp8.training --ddp --shard --fp8-weights --graphs step

Writes <out>/<run>.csv (one row per step), <out>/summary.json and, with --compare, <out>/loss.png
(into a fresh subfolder <out>/<time> when <out> holds an earlier run's files). --out and --save are
checked writable before training. Ctrl-C stops after the step in flight and writes the checkpoint
(--save) and summary.json of what finished; a second Ctrl-C aborts without writing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import zlib
from datetime import datetime, timezone
from pathlib import Path

import torch

from graphfp8.distributed import SettingsMismatchError, check_same_settings
from graphfp8.distributed.replica_check import ReplicaMismatchError
from graphfp8.training import cli_checks
from graphfp8.training.checkpoint import CheckpointError
from graphfp8.training.cli_checks import (
    check_compiled_runs,
    check_device,
    check_fp8_options,
    check_model,
    fraction,
    model_config,
    positive,
)
from graphfp8.training.data import Dataset
from graphfp8.training.determinism import deterministic
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.outputs import OutputError, check_outputs, fresh_out
from graphfp8.training.report import (
    environment,
    plot_losses,
    print_ranks,
    print_table,
    write_summary,
)
from graphfp8.training.run import GRAPH_MODES, PRECISIONS, RECOMPUTE_MODES, SCALINGS, RunSpec
from graphfp8.training.sources import DataError, open_stream
from graphfp8.training.speed import name_baseline

__all__ = ["main", "parse_args", "build_parser"]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default; options whose default depends on others say
    so in their own words (no "(default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default: " in text or action.default is None:
            return text
        return super()._get_help_string(action)


def _add_fp8_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--amax-history-len", type=positive, default=16, help="FP8 delayed scaling")
    p.add_argument("--fp8-format", choices=("HYBRID", "E4M3"), default="HYBRID",
                   help="HYBRID = E4M3 forward, E5M2 gradients; E4M3 = both")  # fmt: skip
    p.add_argument("--scaling", choices=SCALINGS, default="delayed",
                   help="FP8 recipe: DelayedScaling (amax history), Float8CurrentScaling "
                   "(tensor amax) or Float8BlockScaling (1x128 tiles, 128x128 blocks)")  # fmt: skip
    p.add_argument("--fp8-stats", type=positive, metavar="N",
                   help="record every FP8 cast's statistics (amax, scale, saturation, underflow, "
                   "SQNR) every N steps, inside the graphs: <run>_fp8_stats.csv and .png "
                   "(graphfp8.numerics) (default: off)")  # fmt: skip
    p.add_argument("--fp8-weights", action="store_true",
                   help="FP8 primary weights (fp8_model_init) trained through fp32 MasterWeights "
                   "in fp8 runs (default: off)")  # fmt: skip
    p.add_argument("--bf16-layers", default="", help="blocks kept in bf16: first,last or indices")
    p.add_argument("--fp8-attention", action=argparse.BooleanOptionalAction, default=False,
                   help="FP8 attention in fp8 runs: RoPE fused into the FP8 casts of q, k, v, "
                   "cuDNN's FP8 attention, its FP8 output into the projection; on Hopper cuDNN "
                   "trains it at head_dim 128 only (--heads); packed batches (--pack) keep bf16 "
                   "attention")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphfp8-train", description=__doc__.split("\n\nWrites")[0],
                                formatter_class=_Formatter)  # fmt: skip
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: tiny on "
                   "CPU, 100m on CUDA)")  # fmt: skip
    p.add_argument("--precision", choices=PRECISIONS, default="fp8", help="training precision")
    p.add_argument("--graphs", nargs="?", const="layers", default="layers", choices=GRAPH_MODES,
                   help="CUDA graphs (the replay tape on CPU): layers = the transformer blocks, "
                   "step = the whole training step, none = eager; compile = the fair bf16 "
                   "baseline: the same model in plain torch modules under torch.compile, not "
                   "graphed")  # fmt: skip
    p.add_argument("--no-graphs", dest="graphs", action="store_const", const="none",
                   help="= --graphs none (default: off)")  # fmt: skip
    p.add_argument("--steps", type=positive, help="optimizer steps; the LR schedule spans them "
                   "(default: 60 with --preset tiny, else 300)")  # fmt: skip
    p.add_argument("--microbatches", type=positive, default=4, help="per optimizer step")
    _add_shape_options(p)
    _add_data_options(p)
    p.add_argument("--compare", nargs="?", const="bf16,fp8", metavar="RUNS",
                   help="train several runs side by side and plot their losses: comma-separated "
                   "precision[:layers|:step|:none|:compile] (graphs = layers, eager = none; "
                   "bf16:compile is the fair baseline), bf16,fp8 with --graphs' setting when "
                   "RUNS is left out (default: one run, --precision)")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu "
                   "or cuda[:N] (default: cuda when torch sees a GPU, else cpu)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="torch.compile what the graphs do "
                   "not hold: embedding, head, loss (and the blocks when not graphed)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    p.add_argument("--stage-batches", action="store_true", help="copy the next step's batches "
                   "ahead, the same bits (training/staging.py) (default: off)")  # fmt: skip
    _add_fp8_arguments(p)
    p.add_argument("--log-every", type=positive, default=10, metavar="STEPS",
                   help="progress line and CSV rows every STEPS steps")  # fmt: skip
    p.add_argument("--out", type=Path, help="log directory (default: runs/<time>)")
    p.add_argument("--save", type=Path, help="write a checkpoint at the end (default: none)")
    p.add_argument("--resume", type=Path, help="continue from a checkpoint of the same run "
                   "settings, --steps included (default: none)")  # fmt: skip
    p.add_argument("--stop-at", type=positive, metavar="STEP",
                   help="end after this step; the LR schedule still spans --steps; with --save "
                        "to resume later (default: run all --steps)")  # fmt: skip
    cli_checks.add_parallel_arguments(p)
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none", help="per layer")
    p.add_argument("--deterministic", action="store_true",
                   help="the same bits run to run: torch.use_deterministic_algorithms(True), "
                   "cuBLAS's deterministic workspace, deterministic attention backward; bf16 "
                   "attention only on a GPU (docs/training.md: its cost) "
                   "(default: off)")  # fmt: skip
    return p


def _add_shape_options(p: argparse.ArgumentParser) -> None:
    """--batch, --seq-len, --heads and --layers: the preset's shape overridden."""
    p.add_argument("--batch", type=positive, help="sequences per microbatch (default: the "
                   "preset's)")  # fmt: skip
    p.add_argument("--seq-len", type=positive, help="tokens per sequence (default: the "
                   "preset's)")  # fmt: skip
    p.add_argument("--heads", type=positive, help="attention heads (head_dim = hidden / heads; "
                   "the preset's key/value heads stay) (default: the preset's)")  # fmt: skip
    p.add_argument("--layers", type=positive, help="transformer blocks (llama-8b's shapes on one "
                   "GPU: --layers 2) (default: the preset's)")  # fmt: skip


def _add_data_options(p: argparse.ArgumentParser) -> None:
    """--data, --vocab-size and the validation options."""
    p.add_argument("--data", default="stdlib", metavar="PATH|stdlib|synthetic",
                   help="training text: a UTF-8 text file or folder (read as bytes), a nanoGPT "
                   ".bin file of uint16 tokens (uint32 above 65536; with --vocab-size), the "
                   "Python standard library's sources, or the generated language")  # fmt: skip
    p.add_argument("--vocab-size", type=positive, help="vocabulary of a .bin token file "
                   "(default: 256 bytes for text)")  # fmt: skip
    p.add_argument("--val-fraction", type=fraction, default=0.01, help="share of the data, at "
                   "its end, held out for validation (0: none)")  # fmt: skip
    p.add_argument("--eval-every", type=positive, metavar="STEPS", help="validation loss every "
                   "STEPS steps and at the end (default: --steps / 10)")  # fmt: skip
    p.add_argument("--val-batches", type=positive, help="validation set size in microbatches "
                   "of --batch sequences (default: 2 with --preset tiny, else 32)")  # fmt: skip
    p.add_argument("--pack", action="store_true", help="packed documents (the data's files): "
                   "attention and targets stay within each document (default: off)")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    _check(p, args)
    check_fp8_options(p, args, sys.argv[1:] if argv is None else list(argv))
    check_model(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_device(p, args.device)
    if args.preset is None:
        args.preset = "100m" if args.device.startswith("cuda") else "tiny"
    if args.steps is None:
        args.steps = 60 if args.preset.endswith("tiny") else 300
    if args.val_batches is None:
        # On the CPU a validation batch costs about one training microbatch (the FP8 forward
        # GEMMs dominate there): 10 validations of 2 batches add ~8% to the tiny default run.
        args.val_batches = 2 if args.preset.endswith("tiny") else 32
    if args.stop_at is not None and args.stop_at > args.steps:
        p.error(f"--stop-at {args.stop_at} is beyond --steps {args.steps}")
    if args.compare is not None and importlib.util.find_spec("matplotlib") is None:
        p.error("--compare plots the loss curves and needs matplotlib: pip install matplotlib")
    if args.compare is not None and (args.save or args.resume or args.stop_at):
        p.error("--save/--resume/--stop-at work on a single run, not with --compare")
    if args.seq_len is not None and args.seq_len % 16:
        p.error(f"--seq-len must be a multiple of 16 for FP8 GEMMs, got {args.seq_len}")
    if args.shard and not args.ddp:
        p.error("--shard shards over the ranks of --ddp: torchrun --nproc_per_node=N -m "
                "graphfp8.training --ddp --shard")  # fmt: skip
    if args.check_replicas and not args.ddp:
        p.error("--check-replicas compares the ranks of --ddp")
    if args.ddp and "WORLD_SIZE" not in os.environ:
        p.error("--ddp runs under torchrun: torchrun --nproc_per_node=N -m graphfp8.training --ddp")
    if args.resume is not None and not args.resume.is_file():
        p.error(f"--resume: no checkpoint at {args.resume}")
    args.runs = _parse_runs(p, args)
    check_compiled_runs(p, args, args.runs)
    cli_checks.check_fsdp(p, args, {mode for _, mode in args.runs})


_MODE_ALIASES = {"graphs": "layers", "eager": "none"}


def _parse_runs(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.compare is None:
        return [(args.precision, args.graphs)]
    runs = []
    for item in args.compare.split(","):
        precision, _, mode = item.strip().partition(":")
        mode = _MODE_ALIASES.get(mode, mode) or args.graphs
        if precision not in PRECISIONS or mode not in GRAPH_MODES:
            p.error(f"--compare: bad run {item!r}; expected precision[:layers|:step|:none|"
                    f":compile] (or :graphs, :eager) with precision in {PRECISIONS}")  # fmt: skip
        runs.append((precision, mode))
    if len(set(runs)) != len(runs):
        p.error(f"--compare: a run is listed twice in {args.compare!r}")
    return runs


def _spec(args, precision: str, graphs: str, vocab: int) -> RunSpec:
    model = model_config(args, vocab)
    return RunSpec(preset=args.preset, model=model, precision=precision, graphs=graphs,
                   microbatches=args.microbatches, device=args.device, seed=args.seed,
                   amax_history_len=args.amax_history_len,
                   compile=args.compile and graphs != "compile",
                   stage_batches=args.stage_batches,
                   fp8_format=args.fp8_format, scaling=args.scaling,
                   fp8_weights=args.fp8_weights and precision == "fp8", pack=args.pack,
                   fp8_attention=args.fp8_attention and precision == "fp8",
                   shard=args.shard, recompute=args.recompute, fsdp=args.fsdp, hsdp=args.hsdp,
                   fsdp_sync=args.fsdp_sync, fsdp_prefetch=args.fsdp_prefetch,
                   bf16_layers=args.bf16_layers if precision == "fp8" else ())  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    group, rank, world = None, 0, 1
    if args.ddp:
        from graphfp8 import distributed

        kind = "cuda" if args.device.startswith("cuda") else "cpu"
        info = distributed.init_distributed(kind, timeout_s=args.collective_timeout_s)
        rank, world, args.device = info.rank, info.world_size, str(info.device)
        group = torch.distributed.group.WORLD
    where = f" (rank {rank})" if world > 1 else ""
    try:
        with deterministic(args.deterministic):
            return _train_all(args, group, rank, world, argv)
    except (DataError, CheckpointError, SettingsMismatchError, OutputError) as exc:  # at start
        print(f"graphfp8-train: error{where}: {exc}", file=sys.stderr)
        return 2
    except ReplicaMismatchError as exc:  # --check-replicas: every rank stops at the same step
        print(f"graphfp8-train: error{where}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # before training, or a second Ctrl-C (training/interrupt.py)
        print(f"graphfp8-train: interrupted{where}: stopped without writing a checkpoint or "
              "summary.json", file=sys.stderr)  # fmt: skip
        return 130
    finally:
        if args.ddp:
            distributed.cleanup()


def _open_data(args, group) -> Dataset:
    """The run's data; with --ddp, after checking that every rank has the same settings and data
    (a rank that cannot read its data tells the others, so no rank waits for it)."""
    synthetic_bytes = 4 << 20 if not args.preset.endswith("tiny") else 1 << 20
    try:
        data = Dataset(open_stream(args.data, args.vocab_size, synthetic_bytes, args.seed),
                       args.val_fraction, pack=args.pack)  # fmt: skip
        error, seen = None, {k: v for k, v in data.describe().items() if k in _SAME_DATA}
    except DataError as exc:
        error, seen = exc, "unreadable"
    if group is not None:
        if error is None:
            seen["sample_crc32"] = _sample_crc(data)
        options = {k: v for k, v in vars(args).items() if k != "device"}  # device: per rank
        check_same_settings({**options, "data contents": seen}, group)
    if error is not None:
        raise error
    return data


# What the ranks' data must agree on (its location may differ).
_SAME_DATA = ("source", "tokens", "vocab_size", "fingerprint")


def _sample_crc(data: Dataset) -> int:
    """crc32 of the data's first, middle and last 4096 tokens: two files of one size differ."""
    n = len(data.stream)
    starts = sorted({0, max(0, n // 2 - 2048), max(0, n - 4096)})
    return zlib.crc32(b"".join(data.stream.read(s, min(4096, n - s)).numpy().tobytes()
                               for s in starts))  # fmt: skip


def _train_all(args, group, rank: int, world: int, argv) -> int:
    is_main = rank == 0
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = _outputs(args, stamp, group, is_main)
    data = _open_data(args, group)
    specs = [_spec(args, precision, graphs, data.vocab_size) for precision, graphs in args.runs]
    data.check_seq_len(specs[0].model.seq_len)
    results = []
    for spec in specs:
        opts = RunOptions(steps=args.steps, out=out, data=data, log_every=args.log_every,
                          eval_every=args.eval_every, val_batches=args.val_batches,
                          save=args.save, resume=args.resume, group=group, world_size=world,
                          is_main=is_main, stop_at=args.stop_at, fp8_stats=args.fp8_stats or 0,
                          check_replicas=args.check_replicas)  # fmt: skip
        results.append(train_run(spec, opts))
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if results[-1]["interrupted"]:  # Ctrl-C: what finished is written, nothing more runs
            break
    interrupted = results[-1]["interrupted"]
    if not is_main:
        return 130 if interrupted else 0
    for r in results:
        r.pop("model_state")
    print_table(results)
    print_ranks(results, world)
    summary = {"date": stamp, "argv": sys.argv[1:] if argv is None else list(argv),
               "preset": args.preset, "model": specs[0].model.to_dict(),
               "microbatches": args.microbatches, "world_size": world, "data": data.describe(),
               "eval_every": opts.every, "val_batches": args.val_batches,
               "environment": environment(args.device), "runs": results,
               "deterministic": args.deterministic, "interrupted": interrupted,
               "baseline": name_baseline(results)}  # fmt: skip
    print(f"wrote {write_summary(out, summary)}")
    if interrupted:
        r = results[-1]
        print(f"interrupted: {r['name']} stopped after step {r['steps']} of {args.steps}"
              f"{'' if args.save is None else f'; resume with --resume {args.save}'}; "
              f"{len(results) - 1} of {len(specs)} runs had finished")  # fmt: skip
    if args.compare is not None:
        device = environment(args.device).get("gpu", "cpu")
        title = f"{args.preset}, {args.steps} steps, --data {args.data}, {device}"
        print(f"wrote {plot_losses(results, out / 'loss.png', title)}")
    return 130 if interrupted else 0


def _outputs(args, stamp: str, group, is_main: bool) -> Path:
    """The log folder (--out, or a fresh subfolder of it when it holds an earlier run's files),
    with it and --save checked writable on rank 0 before anything else; every rank learns rank
    0's answer, so none waits for a rank that stopped."""
    out, note, problem = args.out or Path("runs") / stamp, None, None
    if is_main:
        files = ["summary.json", "loss.png", *(f"{_spec(args, p, g, 256).name}.csv"
                                               for p, g in args.runs)]  # fmt: skip
        out, note = fresh_out(out, files, stamp)
        try:
            check_outputs(out, args.save)
        except OutputError as exc:
            problem = str(exc)
    if group is not None:
        shared = [out, note, problem]
        torch.distributed.broadcast_object_list(shared, src=0, group=group)
        out, note, problem = shared
    if problem is not None:
        raise OutputError(problem)
    if note is not None and is_main:
        print(f"note: {note}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
