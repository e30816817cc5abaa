"""`python -m benchmarks {kernels,variants,opcount,census,eager,block,attention,step,host,
memory,memory-plan,recompute,stack,glu,hf,hf-users,speed,carried-casts,fsdp-graph,
wgrad-accum,grad-fill,glu-v2} [--device D] [--json PATH] [--quick] [--table]`."""

from __future__ import annotations

import argparse
import importlib

import torch

from benchmarks.common import write_json

SUITES = {
    "kernels": "benchmarks.kernels",
    "variants": "benchmarks.variants",
    "opcount": "benchmarks.opcount",
    "census": "benchmarks.census",
    "eager": "benchmarks.eager",
    "block": "benchmarks.block",
    "stack": "benchmarks.stack",
    "attention": "benchmarks.attention",
    "step": "benchmarks.step",
    "host": "benchmarks.host",
    "memory": "benchmarks.memory",
    "memory-plan": "benchmarks.memory_plan",
    "recompute": "benchmarks.recompute",
    "glu": "benchmarks.glu",
    "hf": "benchmarks.hf",
    "hf-users": "benchmarks.hf_users",
    "speed": "benchmarks.speed",
    "carried-casts": "benchmarks.carried_casts",
    "fsdp-graph": "benchmarks.fsdp_graph",
    "wgrad-accum": "benchmarks.wgrad_accum",
    "grad-fill": "benchmarks.grad_fill",
    "glu-v2": "benchmarks.glu_variants",
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU smoke runs)")
    parser.add_argument(
        "--table",
        action="store_true",
        help="memory: the hidden 2048/4096 table, one process per mode",
    )
    args = parser.parse_args(argv)
    module = importlib.import_module(SUITES[args.suite])
    extra = {"table": True} if args.table else {}
    if extra and args.suite != "memory":
        parser.error("--table is an option of the memory suite")
    result = module.run(args.device, quick=args.quick, **extra)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
