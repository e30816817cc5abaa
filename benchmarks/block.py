"""Block benchmark: the MLP block of docs/benchmarking.md, forward + backward per microbatch, every
peer in one process - device time (CUDA events over back-to-back microbatches), wall time when
synchronising after each microbatch, host enqueue time, kernels per microbatch, and the FP8 GEMM
floor."""

from __future__ import annotations

import gc
import itertools
import statistics
import time

import torch

from benchmarks.common import environment, print_table, time_device, time_host
from benchmarks.kernel_times import kernel_stats
from benchmarks.peers import G8Stack, make_peers
from benchmarks.te_peers import try_build

SHAPES = [(1024, 2048), (2048, 4096), (4096, 8192), (8192, 8192)]


def fp8_gemm_tflops(n: int = 8192) -> float:
    """torch._scaled_mm rate at n^3 with bf16 output, measured now."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def gemm():
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    ms = time_device(gemm, "cuda", iters=10)
    return 2 * n**3 / ms / 1e9


def _sync_wall_ms(fn, iters: int) -> float:
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _measure(step, iters: int) -> dict:
    counter = itertools.count()
    fn = lambda: step(next(counter))  # noqa: E731
    row = {
        "device_ms": time_device(fn, "cuda", warmup=5, iters=iters, repeats=3),
        "host_ms": time_host(fn, "cuda", warmup=2, iters=iters, repeats=3),
        "sync_ms": _sync_wall_ms(fn, iters),
    }
    stats = kernel_stats(fn, iters=4)
    row["kernels"] = sum(c for c, _ in stats.values())
    row["kernel_ms"] = sum(us for _, us in stats.values()) / 1e3
    row["busy"] = min(1.0, row["kernel_ms"] / row["device_ms"])
    # Per-kernel split (GEMMs vs the rest): [name, launches, GPU us] per microbatch, top 15.
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][1])[:15]
    row["top_kernels"] = [[name, count, us] for name, (count, us) in ranked]
    return row


def _fresh_memory() -> None:
    """Frees what the previous peer left (graph pools included) and resets the peaks, so that
    each peer's peak reserved memory is its own (plus the shared inputs)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _measure_built(build, iters: int, name: str = "", failures: dict | None = None):
    """The peer's row; a TE peer that fails to build gives None (its error in failures)."""
    _fresh_memory()
    step = try_build(name, build, failures) if name.startswith("TE") else build()
    if step is None:
        return None
    row = _measure(step, iters)
    row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    del step
    _fresh_memory()
    return row


def bench_shape(hidden: int, tokens: int, tflops: float, compile_peers: bool) -> dict:
    iters = 20 if hidden <= 2048 else 8
    peers = make_peers(hidden, tokens, compile_peers)
    failures: dict = {}
    rows = {name: _measure_built(build, iters, name, failures) for name, build in peers.items()}
    rows = {name: row for name, row in rows.items() if row is not None}
    floor_ms = 48 * tokens * hidden**2 / (tflops * 1e9)
    return {"hidden": hidden, "tokens": tokens, "floor_ms": floor_ms, "peers": rows,
            "failed_peers": failures}  # fmt: skip


def bench_layers(hidden=1024, tokens=2048, counts=(1, 8)) -> list[dict]:
    """Host time per graphed microbatch of a stack of `n` graphfp8 blocks: flat in n."""
    import graphfp8 as g8
    from benchmarks.peers import MICROBATCHES_PER_STEP, RECIPE

    def build(n):
        model = G8Stack(hidden, n)
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        dy = torch.randn_like(x)
        graphed = g8.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=RECIPE,
                                            fp8_weight_caching=True)  # fmt: skip

        def step(i):
            graphed(x, is_first_microbatch=i % MICROBATCHES_PER_STEP == 0).backward(dy)

        return step

    return [{"layers": n, **_measure_built(lambda n=n: build(n), 20)} for n in counts]


def run(device, quick: bool = False, compile_peers: bool = True) -> dict:
    if torch.device(device).type != "cuda":
        raise SystemExit("the block benchmark needs a CUDA GPU")
    tflops = fp8_gemm_tflops()
    shapes = SHAPES[:1] if quick else SHAPES
    results = [bench_shape(h, t, tflops, compile_peers) for h, t in shapes]
    layers = bench_layers()
    text = _tables(results, layers, tflops)
    return {"env": environment(device), "fp8_gemm_tflops": tflops, "shapes": results,
            "layers": layers, "table": text}  # fmt: skip


RATIO_PEERS = ("bf16 eager", "bf16 graphed", "torchao fp8 compile", "graphfp8 fp8 compile",
               "TE fp8 graphed")  # fmt: skip


def _te_table(results) -> str:
    """graphfp8 against TransformerEngine, like for like (each recipe, graphed), and the TE
    peers that failed to build; nothing without TE."""
    pairs = [("graphfp8 fp8 graphed", "TE fp8 graphed"),
             ("graphfp8 fp8 current graphed", "TE fp8 current graphed"),
             ("graphfp8 fp8 eager", "TE fp8 eager")]  # fmt: skip
    failed = {name: err for r in results for name, err in r.get("failed_peers", {}).items()}
    pairs = [(g, t) for g, t in pairs if any(t in r["peers"] for r in results)]
    text = ""
    if pairs:
        text = print_table(
            "graphfp8 time relative to TransformerEngine, same recipe (< 1 is faster)",
            ["h, T", *[f"{g} / {t}" for g, t in pairs]],
            [[f"{r['hidden']}, {r['tokens']}",
              *[r["peers"][g]["device_ms"] / r["peers"][t]["device_ms"]
                if g in r["peers"] and t in r["peers"] else "-" for g, t in pairs]]
             for r in results],
        )  # fmt: skip
    for name, err in failed.items():
        text += f"TE peer {name!r} failed to build: {err}\n"
    return text


def _variants_table(results, names, base: str) -> str:
    """Issue 16's variants (current scaling, FP8 primary weights) relative to `base`."""
    variants = [n for n in ("graphfp8 fp8 current graphed", "graphfp8 fp8w graphed") if n in names]
    return print_table(
        f"graphfp8 variants relative to {base} (DelayedScaling), device time",
        ["h, T", *variants],
        [[f"{r['hidden']}, {r['tokens']}",
          *[r["peers"][v]["device_ms"] / r["peers"][base]["device_ms"] for v in variants]]
         for r in results],
    )  # fmt: skip


def _tables(results, layers, tflops) -> str:
    names = [n for n in results[0]["peers"] if all(n in r["peers"] for r in results)]
    text = print_table(
        f"MLP block fwd+bwd, ms per microbatch (CUDA events, back to back); FP8 GEMM "
        f"{tflops:.0f} TFLOP/s measured",
        ["h, T", *names, "FP8 GEMM floor"],
        [[f"{r['hidden']}, {r['tokens']}", *[r["peers"][n]["device_ms"] for n in names],
          r["floor_ms"]] for r in results],
    )  # fmt: skip
    per_peer = [
        ("ms per microbatch, synchronising after each (docs/benchmarking.md's peer method)",
         lambda p: p["sync_ms"]),
        ("host enqueue ms per microbatch", lambda p: p["host_ms"]),
        ("kernels per microbatch / GPU busy fraction",
         lambda p: f"{p['kernels']:.0f} / {p['busy']:.2f}"),
        ("peak reserved MiB per peer (torch.cuda.max_memory_reserved, one peer at a time)",
         lambda p: p["peak_reserved_bytes"] / 2**20),
    ]  # fmt: skip
    for title, cell in per_peer:
        rows = [[f"{r['hidden']}, {r['tokens']}", *[cell(r["peers"][n]) for n in names]]
                for r in results]  # fmt: skip
        text += print_table(title, ["h, T", *names], rows)
    g8g = "graphfp8 fp8 graphed"
    ratio_rows = []
    for r in results:
        p = r["peers"]
        row = [f"{r['hidden']}, {r['tokens']}"]
        for peer in RATIO_PEERS:
            row.append(p[g8g]["device_ms"] / p[peer]["device_ms"] if peer in p else "-")
        row.append(p[g8g]["device_ms"] / r["floor_ms"])
        ratio_rows.append(row)
    text += print_table(
        "graphfp8 fp8 graphed time relative to each peer (< 1 is faster)",
        ["h, T", *[f"/ {peer}" for peer in RATIO_PEERS], "/ FP8 floor"],
        ratio_rows,
    )
    text += _te_table(results)
    text += _variants_table(results, names, g8g)
    text += print_table(
        "graphed graphfp8 stack, h=1024 T=2048: host enqueue per microbatch vs layers",
        ["layers", "host ms", "device ms", "kernels", "peak reserved MiB"],
        [
            [
                r["layers"],
                r["host_ms"],
                r["device_ms"],
                r["kernels"],
                r["peak_reserved_bytes"] / 2**20,
            ]
            for r in layers
        ],  # fmt: skip
    )
    return text
