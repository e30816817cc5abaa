"""Issue 33's kernels under Nsight Compute: the norm backward, the GELU / dGELU / GLU casts and
current scaling's amax passes at the shapes the issue measures, beside a bf16 copy and the plain
cast-transpose of the same size, each launched once inside cudaProfilerStart/Stop (gpu_check.sh
step `ncu`).

    ncu --profile-from-start off --clock-control none --section ... --csv --page details \
        python scripts/ncu_kernels.py run > ncu.csv
    python scripts/ncu_kernels.py summary ncu.csv      # one line per kernel: the counters that
                                                        # say memory-, latency- or issue-bound

`run` prints the profiled calls in launch order (an op may launch two kernels: the dbias and
norm-gradient reductions); `summary` lists the kernels in the same order. Kernel switches come
from the environment as usual (GRAPHFP8_<NAME>=1), so the same driver profiles a candidate
variant beside the default.
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16 = torch.bfloat16

# (metric name in ncu's details page, column header): what tells the bottleneck apart.
SUMMARY = [
    ("Duration", "us"),
    ("DRAM Throughput", "DRAM %"),
    ("Memory Throughput", "mem %"),
    ("Memory Throughput (Memory Workload Analysis)", "mem B/s"),
    ("Compute (SM) Throughput", "SM %"),
    ("L2 Hit Rate", "L2 hit %"),
    ("Registers Per Thread", "regs"),
    ("Shared Memory Configuration Size", "smem cfg KB"),
    ("Dynamic Shared Memory Per Block", "dyn smem"),
    ("Static Shared Memory Per Block", "static smem"),
    ("Theoretical Occupancy", "theor occ %"),
    ("Achieved Occupancy", "achieved occ %"),
    ("Block Limit Registers", "lim regs"),
    ("Block Limit Shared Mem", "lim smem"),
    ("Waves Per SM", "waves"),
    ("Issued Warp Per Scheduler", "issued/sched"),
    ("Eligible Warps Per Scheduler", "eligible/sched"),
    ("No Eligible", "no eligible %"),
    ("Warp Cycles Per Issued Instruction", "cyc/issue"),
]


def _rmsnorm_bwd_cases(ops, rand, one, amax) -> list[tuple[str, object]]:
    """Issue 41 cut 4: the RMSNorm backward at Llama-1B's and Llama-8B's norm shapes."""
    cases = []
    for m, n in ((4096, 2048), (8192, 4096)):
        x, g, dy, res = rand(m, n), rand(n), rand(m, n), rand(m, n)
        rs = ops.rmsnorm_fp8(x, g, 1e-5, one, amax, E4M3).rsigma
        cases += [
            (f"rmsnorm_bwd {m}x{n}", lambda dy=dy, x=x, s=rs, g=g: ops.rmsnorm_bwd(dy, x, s, g)),
            (f"rmsnorm_bwd + dresidual {m}x{n}",
             lambda dy=dy, x=x, s=rs, g=g, r=res: ops.rmsnorm_bwd(dy, x, s, g, dresidual=r)),
        ]  # fmt: skip
    return cases


def _cases(device) -> list[tuple[str, object]]:
    """(label, zero-argument call) in launch order; inputs are made here, before profiling."""
    from graphfp8 import ops  # noqa: PLC0415 (after argument parsing: `summary` needs no torch ext)

    torch.manual_seed(0)
    one = torch.ones(1, device=device)
    amax = torch.zeros(1, device=device)
    cases = []

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=BF16)

    for m, n in ((8192, 1024), (8192, 4096)):
        x, dst = rand(m, n), torch.empty(m, n, device=device, dtype=BF16)
        cases.append((f"copy bf16 {m}x{n}", lambda x=x, dst=dst: dst.copy_(x)))
        g, b = rand(n), rand(n)
        o = ops.layernorm_fp8(x, g, b, 1e-5, one, amax, E4M3, transpose=True)
        dy, res = rand(m, n), rand(m, n)
        cases.append((f"layernorm_fp8 + transpose {m}x{n}",
                      lambda x=x, g=g, b=b: ops.layernorm_fp8(x, g, b, 1e-5, one, amax, E4M3,
                                                              transpose=True)))  # fmt: skip
        cases.append(
            (
                f"layernorm_bwd {m}x{n}",
                lambda dy=dy, x=x, o=o, g=g: ops.layernorm_bwd(dy, x, o.mu, o.rsigma, g),
            )
        )
        cases.append((f"layernorm_bwd + dresidual {m}x{n}",
                      lambda dy=dy, x=x, o=o, g=g, r=res: ops.layernorm_bwd(
                          dy, x, o.mu, o.rsigma, g, dresidual=r)))  # fmt: skip
    cases += _rmsnorm_bwd_cases(ops, rand, one, amax)
    m, f = 8192, 4096  # the 100m preset's fc1 output: T x 4h
    h, dy = rand(m, f), rand(m, f)
    cases += [
        (f"cast_transpose {m}x{f}", lambda: ops.cast_transpose(h, one, amax, E4M3)),
        (f"cast_transpose_dbias {m}x{f}", lambda: ops.cast_transpose_dbias(dy, one, amax, E5M2)),
        (f"gelu_cast_transpose {m}x{f}", lambda: ops.gelu_cast_transpose(h, one, amax, E4M3)),
        (
            f"dgelu_cast_transpose_dbias {m}x{f}",
            lambda: ops.dgelu_cast_transpose_dbias(dy, h, one, amax, E5M2),
        ),
        (f"amax {m}x{f} (current scaling's pass)", lambda: ops.amax_(h, amax)),
        (f"gelu_amax {m}x{f}", lambda: ops.gelu_amax_(h, amax)),
        (f"dgelu_amax {m}x{f}", lambda: ops.dgelu_amax_(dy, h, amax)),
    ]
    f = 2816  # llama-100m's SwiGLU width
    hg, da = rand(m, 2 * f), rand(m, f)
    cases += [
        (f"glu_cast_transpose swiglu {m}x{2 * f}",
         lambda: ops.glu_cast_transpose(hg, "swiglu", one, amax, E4M3)),
        (f"dglu_cast_transpose_dbias swiglu {m}x{f}",
         lambda: ops.dglu_cast_transpose_dbias(da, hg, "swiglu", one, amax, E5M2, dbias=False)),
    ]  # fmt: skip
    return cases


def run(device: str = "cuda", only: str = "") -> None:
    """Warms every case up, then launches each once between cudaProfilerStart and Stop (on the
    CPU: once each, a smoke run); only: the cases whose label contains it."""
    from graphfp8.ops.switches import SWITCHES, switch_on  # noqa: PLC0415

    device = torch.device(device)
    cuda = device.type == "cuda"
    cases = [case for case in _cases(device) if only in case[0]]
    for _, call in cases:  # warm up: module loading, first-launch costs, allocator
        call()
    if cuda:
        torch.cuda.synchronize()
    print("switches: " + ", ".join(f"{s}={int(switch_on(s))}" for s in SWITCHES), file=sys.stderr)
    cudart = torch.cuda.cudart() if cuda else None
    if cuda:
        cudart.cudaProfilerStart()
    for i, (label, call) in enumerate(cases):
        call()
        if cuda:
            torch.cuda.synchronize()
        print(f"call {i}: {label}", file=sys.stderr)
    if cuda:
        cudart.cudaProfilerStop()


def _short(name: str) -> str:
    """The kernel's name without namespaces and parameter list, template arguments kept."""
    for prefix in ("void ", "(anonymous namespace)::", "graphfp8::", "cuda::", "at::native::"):
        name = name.replace(prefix, "")
    if name.endswith(")"):
        name = name[: name.rfind("(")]
    return name[:110]


def summary(path: str) -> None:
    rows: dict[str, dict] = {}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not CSV
    for rec in csv.DictReader(lines):
        kid = rec["ID"]
        row = rows.setdefault(kid, {"kernel": _short(rec["Kernel Name"]),
                                    "grid": rec.get("Grid Size", ""),
                                    "block": rec.get("Block Size", "")})  # fmt: skip
        name = rec["Metric Name"]
        if name in row:  # the same name in two sections (Memory Throughput: % and bytes/s)
            name = f"{name} ({rec['Section Name']})"
        row[name] = rec["Metric Value"] + (
            "" if rec["Metric Unit"] in ("", "%", "register/thread") else f" {rec['Metric Unit']}"
        )
    head = ["id", "kernel", "grid", "block", *(h for _, h in SUMMARY)]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for kid, row in sorted(rows.items(), key=lambda kv: int(kv[0])):
        cells = [kid, row["kernel"], row["grid"], row["block"],
                 *(row.get(metric, "") for metric, _ in SUMMARY)]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python scripts/ncu_kernels.py")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="launch the kernels (under ncu --profile-from-start off)")
    r.add_argument("--device", default="cuda", help="cpu: a smoke run of the same calls")
    r.add_argument("--only", default="", help="the cases whose label contains this")
    s = sub.add_parser("summary", help="one line per kernel of ncu's --csv --page details")
    s.add_argument("csv")
    args = p.parse_args(argv)
    if args.what == "run":
        run(args.device, args.only)
    else:
        summary(args.csv)


if __name__ == "__main__":
    main()
