"""The largest model the memory planner fits on one H200, trained: graphfp8-train --preset llama-8b
--layers L, L the planner's deepest model of Llama-3-8B's layer shape whose footprint fits one
H200 (graphfp8.memory.plan.largest_fit: FP8 weights, full recompute, per-layer graphs, B1 x
S8192), for a few steps of synthetic data; its summary.json's peak allocated and reserved bytes
and tokens/s beside the plan of the same config (plan/measured).

    python -m benchmarks.largest_model --out DIR          (the H200: scripts/gpu_check.sh step big)
    python -m benchmarks.largest_model --out DIR --preset llama-tiny --layers 2 --seq-len 64 \\
        --device cpu                                      (the same flags at CPU size: the test)

Per-layer graphs fit the deepest model of the graph modes (26 layers, 6.72B): the step graph keeps
its fp32 master gradients (24 layers, 6.29B; its capture's undo copy is host memory, dropped after
the capture: docs/sharding.md, "Memory planner").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from graphfp8.memory.plan import largest_fit, plan
from graphfp8.memory.shapes import shape_from
from graphfp8.training.cli import main as train_main
from graphfp8.training.model import PRESETS, ModelConfig

__all__ = ["main", "planned_layers"]

RECOMPUTE = "full"


def planned_layers(preset: str, seq: int, graphs: str) -> int:
    """The planner's deepest model of `preset`'s layer shape that fits one H200."""
    fit = largest_fit(shape_from(PRESETS[preset]), 1, seq=seq, batch=1, recompute=RECOMPUTE,
                      fp8_weights=True, graphs=graphs)  # fmt: skip
    if fit is None:
        raise SystemExit(f"largest_model: not one layer of {preset} fits an H200")
    return fit.setting["shape"]["layers"]


def train_args(args, layers: int, out: Path) -> list[str]:
    """graphfp8-train's command line of the run."""
    return ["--preset", args.preset, "--layers", str(layers), "--fp8-weights",
            "--recompute", RECOMPUTE, "--graphs", args.graphs, "--batch", "1",
            "--seq-len", str(args.seq_len), "--microbatches", str(args.microbatches),
            "--steps", str(args.steps), "--log-every", str(args.steps), "--data", "synthetic",
            "--val-batches", "1", "--device", args.device, "--out", str(out)]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.largest_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="graphfp8-train's output and big.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-8b")
    p.add_argument("--layers", type=int, help="default: the planner's deepest that fits an H200")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--graphs", choices=("none", "layers", "step"), default="layers")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    layers = args.layers or planned_layers(args.preset, args.seq_len, args.graphs)
    run_out = args.out / "run"
    command = train_args(args, layers, run_out)
    print("graphfp8-train " + " ".join(command), flush=True)
    rc = train_main(command)
    if rc != 0:
        print(f"largest_model: graphfp8-train exited with {rc}")
        return rc
    summary = json.loads((run_out / "summary.json").read_text())
    run = summary["runs"][0]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in summary["model"].items() if k in fields})
    planned = plan(shape_from(cfg), seq=cfg.seq_len, batch=cfg.batch, recompute=RECOMPUTE,
                   fp8_weights=True, graphs=args.graphs)  # fmt: skip
    peak = run["memory_per_rank"][0]["max_allocated_bytes"]
    reserved = run["peak_reserved_bytes"]
    result = {
        "command": "graphfp8-train " + " ".join(command),
        "layers": layers,
        "parameters": run["parameters"],
        "planned_parameters": planned.parameters,
        "max_allocated_bytes": peak,
        "peak_reserved_bytes": reserved,
        "tokens_per_s": run["tokens_per_s"],
        "model_tflops": run.get("model_tflops"),
        "final_loss": run["final_loss"],
        "plan": planned.to_dict(),
        "planned_over_measured": planned.peak / peak if peak else None,
        "footprint_over_reserved": planned.footprint / reserved if reserved else None,
    }
    (args.out / "big.json").write_text(json.dumps(result, indent=1))
    gib = 2**30
    measured = f"{peak / gib:.2f} GiB" if peak else "-"
    ratio = f"{result['planned_over_measured']:.3f}" if peak else "-"
    print(f"### largest model on one GPU: {args.preset} {layers} layers, "
          f"{run['parameters'] / 1e9:.3f}B parameters, FP8 weights, recompute {RECOMPUTE}, "
          f"graphs {args.graphs}, B1 x S{cfg.seq_len}")  # fmt: skip
    print(f"| peak allocated {measured} | planned {planned.peak / gib:.2f} GiB | plan/measured "
          f"{ratio} | reserved {reserved / gib if reserved else 0:.2f} GiB | planned footprint "
          f"{planned.footprint / gib:.2f} GiB | tokens/s {run['tokens_per_s'] or 0:,.0f} | "
          f"final loss {run['final_loss']:.4f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
