"""`python -m graphfp8.bench {kernels,eager,block,attention,step,stack} [--device D]
[--json P] [--quick]`."""

from __future__ import annotations

import argparse
import importlib

import torch

from graphfp8.bench.common import write_json

SUITES = {
    "kernels": "graphfp8.bench.kernels",
    "eager": "graphfp8.bench.eager",
    "block": "graphfp8.bench.block",
    "stack": "graphfp8.bench.stack",
    "attention": "graphfp8.bench.attention",
    "step": "graphfp8.bench.step",
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m graphfp8.bench", description=__doc__)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU smoke runs)")
    args = parser.parse_args(argv)
    module = importlib.import_module(SUITES[args.suite])
    result = module.run(args.device, quick=args.quick)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
