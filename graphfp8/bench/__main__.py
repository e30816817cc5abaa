"""`python -m graphfp8.bench {kernels,variants,opcount,census,eager,block,attention,step,host,
memory,stack,glu,hf,hf-users,carry} [--device D]
[--json PATH] [--quick] [--table]`."""

from __future__ import annotations

import argparse
import importlib

import torch

from graphfp8.bench.common import write_json

SUITES = {
    "kernels": "graphfp8.bench.kernels",
    "variants": "graphfp8.bench.variants",
    "opcount": "graphfp8.bench.opcount",
    "census": "graphfp8.bench.census",
    "eager": "graphfp8.bench.eager",
    "block": "graphfp8.bench.block",
    "stack": "graphfp8.bench.stack",
    "attention": "graphfp8.bench.attention",
    "step": "graphfp8.bench.step",
    "host": "graphfp8.bench.host",
    "memory": "graphfp8.bench.memory",
    "glu": "graphfp8.bench.glu",
    "hf": "graphfp8.bench.hf",
    "hf-users": "graphfp8.bench.hf_users",
    "carry": "graphfp8.bench.carry",
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m graphfp8.bench", description=__doc__)
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
