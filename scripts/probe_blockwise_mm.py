"""Probes what this torch's scaled matmul accepts for blockwise FP8 on this GPU (1x128 tiles x
128x128 blocks, 1x128 x 1x128), which scale layouts give the right numbers, whether a CUDA graph
captures it, and how fast it is beside a per-tensor GEMM. Run on the H200:

    python scripts/probe_blockwise_mm.py [--out profiles/blockwise_mm_probe.json]

Each variant is compared with graphfp8's CPU emulation of the same quantized operands
(graphfp8/ops/blockwise.py); "matches" means max |out - emulation| <= 1e-3 max |emulation|, plus
for bf16 out one bf16 rounding of the largest value (2**-8 max |emulation|). The
variant named "graphfp8" is the layout GRAPHFP8_BLOCKWISE_GEMM=scaled_mm uses.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from graphfp8.ops import blockwise as bw

E4M3 = torch.float8_e4m3fn


def _operands(m: int, n: int, k: int, b_rows: int):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).pow(3).to(torch.bfloat16)
    b = torch.randn(n, k, generator=gen).pow(3).to(torch.bfloat16)
    a_fp8, a_inv = bw.quantize_tiles(a)
    b_fp8, b_inv = (bw.quantize_tiles if b_rows == 1 else bw.quantize_blocks)(b)
    want = bw.blockwise_gemm(a_fp8, a_inv, b_fp8, b_inv, torch.float32)  # CPU emulation
    return [t.cuda() for t in (a_fp8, a_inv, b_fp8, b_inv)], want


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    return s.t().contiguous().t()


def _variants(b_rows: int):
    """name -> fn(a_fp8, a_inv, b_fp8, b_inv, out_dtype) for each layout worth trying."""
    out = {}
    st = getattr(F, "ScalingType", None)
    if st is not None and hasattr(F, "scaled_mm"):
        rb = st.BlockWise1x128 if b_rows == 1 else st.BlockWise128x128

        def v2(scale_b):
            return lambda a, sa, b, sb, dt: F.scaled_mm(
                a, b.t(), _outer_major(sa), st.BlockWise1x128, scale_b(sb), rb, output_dtype=dt
            )

        if b_rows == 1:
            out["F.scaled_mm b outer-major"] = v2(_outer_major)
            out["F.scaled_mm b transposed"] = v2(lambda s: _outer_major(s).t())
        else:
            pad = lambda s: F.pad(s, (0, -s.shape[1] % 4))  # noqa: E731
            out["F.scaled_mm b padded-L4 transposed"] = v2(lambda s: pad(s).t())
            out["F.scaled_mm b transposed"] = v2(lambda s: s.t())
            out["F.scaled_mm b as is"] = v2(lambda s: s.contiguous())
    out["torch._scaled_mm shapes (inferred)"] = lambda a, sa, b, sb, dt: torch._scaled_mm(
        a, b.t(), _outer_major(sa), (_outer_major(sb) if b_rows == 1 else sb).t(), out_dtype=dt
    )

    def graphfp8(a, sa, b, sb, dt):
        bw.GEMM_MODE = "scaled_mm"
        return bw.blockwise_gemm(a, sa, b, sb, dt)

    out["graphfp8"] = graphfp8
    return out


def _try(fn, args, want, out_dtype) -> dict:
    try:
        got = fn(*args, out_dtype).float().cpu()
    except Exception as exc:  # what torch refuses is the probe's result
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:800]}"}
    err, top = (got - want).abs().max().item(), want.abs().max().item()
    tol = 1e-3 * top + (2.0**-8 * top if out_dtype == torch.bfloat16 else 0.0)
    return {"ok": True, "max_abs_err": err, "matches": err <= tol}


def _graph_ok(fn, args, out_dtype) -> str:
    """Captures fn in a CUDA graph and replays it: 'equal' when the replay gives the eager bits."""
    try:
        eager = fn(*args, out_dtype)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(*args, out_dtype)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static = fn(*args, out_dtype)
        g.replay()
        torch.cuda.synchronize()
        return "equal" if torch.equal(static, eager) else "differs"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def _speed(fn, m: int, n: int, k: int) -> dict:
    """ms per GEMM of the variant and of a per-tensor _scaled_mm of the same shape."""
    (a, sa, b, sb), _ = _operands(m, n, k, 128)
    one = torch.ones((), device="cuda")

    def timed(call) -> float:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 20 * 1e3

    block = timed(lambda: fn(a, sa, b, sb, torch.bfloat16))
    tensor = timed(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
    return {"shape": [m, n, k], "blockwise_ms": block, "per_tensor_ms": tensor,
            "ratio": block / tensor}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the results as JSON here too")
    args = p.parse_args()
    cap = torch.cuda.get_device_capability()
    report = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name(), "capability": list(cap),
              "date": time.strftime("%Y-%m-%d"), "results": []}  # fmt: skip
    for b_rows in (128, 1):
        for m, n, k in ((256, 384, 512), (256, 384, 300), (200, 384, 512)):
            operands, want = _operands(m, n, k, b_rows)
            for name, fn in _variants(b_rows).items():
                for dt in (torch.bfloat16, torch.float32):
                    row = {"b": "128x128" if b_rows == 128 else "1x128", "mnk": [m, n, k],
                           "variant": name, "out": str(dt)}  # fmt: skip
                    row.update(_try(fn, operands, want, dt))
                    if row["ok"] and (m, n, k) == (256, 384, 512):
                        row["cuda_graph"] = _graph_ok(fn, operands, dt)
                    report["results"].append(row)
                    print(json.dumps(row))
    fns = _variants(128)
    working = [r["variant"] for r in report["results"]
               if r["ok"] and r["matches"] and r["b"] == "128x128"]  # fmt: skip
    if working:
        report["speed"] = [_speed(fns[working[0]], *s) for s in ((4096, 2048, 2048),
                                                                  (4096, 8192, 2048),
                                                                  (4096, 2048, 8192))]  # fmt: skip
        print(json.dumps(report["speed"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
