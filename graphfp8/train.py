"""The main job: train a small GPT of graphfp8.TransformerLayers on the embedded corpus.

    graphfp8-train                                # FP8 + graphs, tiny preset on CPU, 100m on GPU
    graphfp8-train --precision bf16 --no-graphs --steps 200
    graphfp8-train --graphs step                  # the whole training step as one graph
    graphfp8-train --compare                      # bf16 and fp8 side by side, loss plot
    graphfp8-train --compare bf16:eager,bf16:graphs,fp8:graphs --preset 100m
    graphfp8-train --compare fp8:layers,fp8:step --preset small
    graphfp8-train --steps 100 --save ckpt.pt ; graphfp8-train --steps 200 --resume ckpt.pt
    torchrun --nproc_per_node=2 -m graphfp8.train --ddp

Writes <out>/<run>.csv (one row per step), <out>/summary.json and, with --compare, <out>/loss.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from graphfp8.training.data import make_corpus
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.report import plot_losses, write_summary
from graphfp8.training.run import GRAPH_MODES, PRECISIONS, RunSpec

__all__ = ["main", "parse_args"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="graphfp8-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: tiny on "
                   "CPU, 100m on CUDA)")  # fmt: skip
    p.add_argument("--precision", choices=PRECISIONS, default="fp8")
    p.add_argument(
        "--graphs",
        nargs="?",
        const="layers",
        default="layers",
        choices=GRAPH_MODES,
        help="CUDA graphs (the replay tape on CPU): layers = the transformer blocks (default), "
        "step = the whole training step, none = eager",
    )
    p.add_argument("--no-graphs", dest="graphs", action="store_const", const="none",
                   help="= --graphs none")  # fmt: skip
    p.add_argument("--steps", type=_positive, help="optimizer steps (default: 60 tiny, 300 else)")
    p.add_argument("--microbatches", type=_positive, default=4, help="per optimizer step")
    p.add_argument("--batch", type=_positive, help="sequences per microbatch (preset's default)")
    p.add_argument("--seq-len", type=_positive, help="tokens per sequence (preset's default)")
    p.add_argument(
        "--compare",
        nargs="?",
        const="bf16,fp8",
        metavar="RUNS",
        help="train several runs side by side: comma-separated precision[:layers|:step|:none] "
        "(graphs = layers, eager = none; default bf16,fp8, with --graphs' setting) and plot the "
        "losses",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amax-history-len", type=_positive, default=16)
    p.add_argument("--log-every", type=_positive, default=10)
    p.add_argument("--out", type=Path, help="log directory (default runs/<time>)")
    p.add_argument("--save", type=Path, help="write a checkpoint at the end")
    p.add_argument("--resume", type=Path, help="continue from a checkpoint (same run settings)")
    p.add_argument("--stop-at", type=_positive, metavar="STEP",
                   help="end after this step (the LR schedule still spans --steps); with --save "
                        "to resume later")  # fmt: skip
    p.add_argument("--ddp", action="store_true", help="data parallel over torchrun's processes")
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU (this torch build: "
                f"{torch.__version__}); use --device cpu")  # fmt: skip
    if args.preset is None:
        args.preset = "100m" if args.device.startswith("cuda") else "tiny"
    if args.steps is None:
        args.steps = 60 if args.preset == "tiny" else 300
    if args.compare is not None and importlib.util.find_spec("matplotlib") is None:
        p.error("--compare plots the loss curves and needs matplotlib: pip install matplotlib")
    if args.compare is not None and (args.save or args.resume or args.stop_at):
        p.error("--save/--resume/--stop-at work on a single run, not with --compare")
    if args.seq_len is not None and args.seq_len % 16:
        p.error(f"--seq-len must be a multiple of 16 for FP8 GEMMs, got {args.seq_len}")
    if args.ddp and "WORLD_SIZE" not in os.environ:
        p.error("--ddp runs under torchrun: torchrun --nproc_per_node=N -m graphfp8.train --ddp")
    if args.resume is not None and not args.resume.is_file():
        p.error(f"--resume: no checkpoint at {args.resume}")
    args.runs = _parse_runs(p, args)


_MODE_ALIASES = {"graphs": "layers", "eager": "none"}


def _parse_runs(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.compare is None:
        return [(args.precision, args.graphs)]
    runs = []
    for item in args.compare.split(","):
        precision, _, mode = item.strip().partition(":")
        mode = _MODE_ALIASES.get(mode, mode) or args.graphs
        if precision not in PRECISIONS or mode not in GRAPH_MODES:
            p.error(f"--compare: bad run {item!r}; expected precision[:layers|:step|:none] "
                    f"(or :graphs, :eager) with precision in {PRECISIONS}")  # fmt: skip
        runs.append((precision, mode))
    if len(set(runs)) != len(runs):
        p.error(f"--compare: a run is listed twice in {args.compare!r}")
    return runs


def _spec(args, precision: str, graphs: str) -> RunSpec:
    model = PRESETS[args.preset]
    overrides = {k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len)) if v}
    if overrides:
        model = type(model)(**{**model.to_dict(), **overrides})
    return RunSpec(preset=args.preset, model=model, precision=precision, graphs=graphs,
                   microbatches=args.microbatches, device=args.device, seed=args.seed,
                   amax_history_len=args.amax_history_len)  # fmt: skip


def _environment(device: str) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env


def _print_table(results: list[dict]) -> None:
    base = results[0]
    print(f"\n{'run':>14} {'final loss':>10} {'vs first':>9} {'tokens/s':>12} {'speed-up':>8}")
    for r in results:
        dl = (r["final_loss"] / base["final_loss"] - 1) * 100
        tps = r["tokens_per_s"] or float("nan")
        speed = tps / (base["tokens_per_s"] or float("nan"))
        print(f"{r['name']:>14} {r['final_loss']:>10.4f} {dl:>+8.2f}% {tps:>12,.0f} {speed:>7.2f}x")


def main(argv=None) -> int:
    args = parse_args(argv)
    group, rank, world = None, 0, 1
    if args.ddp:
        from graphfp8 import distributed

        info = distributed.init_distributed("cuda" if args.device.startswith("cuda") else "cpu")
        rank, world, args.device = info.rank, info.world_size, str(info.device)
        group = torch.distributed.group.WORLD
    try:
        return _train_all(args, group, rank, world, argv)
    finally:
        if args.ddp:
            distributed.cleanup()


def _train_all(args, group, rank: int, world: int, argv) -> int:
    is_main = rank == 0
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("runs") / stamp
    corpus = make_corpus(4 << 20 if args.preset != "tiny" else 1 << 20, seed=args.seed)
    results = []
    for precision, graphs in args.runs:
        spec = _spec(args, precision, graphs)
        opts = RunOptions(steps=args.steps, out=out, log_every=args.log_every, save=args.save,
                          resume=args.resume, group=group, world_size=world, is_main=is_main,
                          corpus=corpus, stop_at=args.stop_at)  # fmt: skip
        results.append(train_run(spec, opts))
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if not is_main:
        return 0
    for r in results:
        r.pop("model_state")
    _print_table(results)
    for r in results:
        if r["ranks_agree"] is not None:
            agree = ", ".join(f"{k} {'identical' if v else 'DIFFERENT'}"
                              for k, v in r["ranks_agree"].items())  # fmt: skip
            print(f"{r['name']}: across {world} ranks: {agree}")
    summary = {"date": stamp, "argv": sys.argv[1:] if argv is None else list(argv),
               "preset": args.preset, "model": _spec(args, *args.runs[0]).model.to_dict(),
               "microbatches": args.microbatches, "world_size": world,
               "environment": _environment(args.device), "runs": results}  # fmt: skip
    print(f"wrote {write_summary(out, summary)}")
    if args.compare is not None:
        title = f"{args.preset}, {args.steps} steps, {_environment(args.device).get('gpu', 'cpu')}"
        curves = {r["name"]: r["losses"] for r in results}
        print(f"wrote {plot_losses(curves, out / 'loss.png', title)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
