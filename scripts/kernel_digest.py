"""Digests (sha256) of every graphfp8 kernel's outputs on fixed random inputs, to compare two
builds bit for bit: scripts/bench_before_after.sh runs it under each build and diffs the JSON.

Only the dispatcher ops are called (torch.ops.graphfp8.*, whose signatures both builds share);
an op that a build lacks is left out of its digest and reported as missing by the comparison.

    python scripts/kernel_digest.py [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math

import torch

import graphfp8.ops  # noqa: F401  (registers torch.ops.graphfp8)

OPS = torch.ops.graphfp8
HP = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Vector tiles, scalar tiles (odd sizes), one row, one column.
SHAPES = [(256, 1024), (128, 48), (130, 258), (37, 53), (1, 33), (7, 1)]


def _data(shape, dtype, gen, device):
    """~7 decades of magnitudes with +-inf, NaN and signed zeros, like graphfp8.testing's."""
    x = torch.randn(shape, generator=gen) * torch.pow(
        10.0, torch.empty(shape).uniform_(-4, 3, generator=gen)
    )
    flat = x.view(-1)
    if flat.numel() >= 6:
        idx = torch.randperm(flat.numel(), generator=gen)[:6]
        flat[idx] = torch.tensor([math.inf, -math.inf, math.nan, -math.nan, 0.0, -0.0])
    return x.to(dtype).to(device)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _scalars(device, gen):
    scale = torch.empty(1).uniform_(0.05, 20.0, generator=gen).to(device)
    amax = torch.empty(1).uniform_(0.0, 1.0, generator=gen).to(device)
    return scale, amax, torch.full((1,), 7.0, device=device)


def _cast_cases(device, gen):
    for hp in HP:
        for f8 in FP8:
            for shape in SHAPES:
                x = _data(shape, hp, gen, device)
                rows, cols = shape
                for noop in (None, 0.0, 1.0):
                    flag = None if noop is None else torch.full((1,), noop, device=device)
                    scale, amax, scale_inv = _scalars(device, gen)
                    out = torch.zeros(shape, dtype=f8, device=device)
                    out_t = torch.zeros(cols, rows, dtype=f8, device=device)
                    OPS.cast_transpose(x, scale, out, out_t, scale_inv, amax, flag)
                    yield (
                        f"cast_transpose/{hp}/{f8}/{shape}/noop={noop}",
                        [out, out_t, scale_inv, amax],
                    )
                    scale, amax, scale_inv = _scalars(device, gen)
                    out = torch.zeros(shape, dtype=f8, device=device)
                    OPS.cast_to_fp8(x, scale, out, scale_inv, amax, flag)
                    yield f"cast_to_fp8/{hp}/{f8}/{shape}/noop={noop}", [out, scale_inv, amax]
                back = torch.zeros(shape, dtype=hp, device=device)
                OPS.dequantize(out, scale_inv, back)
                yield f"dequantize/{f8}/{hp}/{shape}", [back]


def _transpose_cases(device, gen):
    for f8 in FP8:
        for shape in SHAPES + [(300, 1040), (64, 64)]:
            x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(f8).to(device)
            for noop in (None, 0.0, 1.0):
                flag = None if noop is None else torch.full((1,), noop, device=device)
                out_t = torch.zeros(shape[::-1], dtype=f8, device=device)
                OPS.fp8_transpose(x, out_t, flag)
                yield f"fp8_transpose/{f8}/{shape}/noop={noop}", [out_t]


def _fused_cases(device, gen):
    for hp in HP:
        for f8 in FP8:
            for shape in SHAPES:
                dy = _data(shape, hp, gen, device).clamp(-1e3, 1e3)
                x = (torch.randn(shape, generator=gen) * 3).to(hp).to(device)
                rows, cols = shape
                for op in ("cast_transpose_dbias", "gelu_cast_transpose",
                           "dgelu_cast_transpose_dbias"):  # fmt: skip
                    scale, amax, scale_inv = _scalars(device, gen)
                    out = torch.zeros(shape, dtype=f8, device=device)
                    out_t = torch.zeros(cols, rows, dtype=f8, device=device)
                    outs = [out, out_t, scale_inv, amax]
                    dbias = torch.zeros(cols, dtype=hp, device=device)
                    if op == "cast_transpose_dbias":
                        OPS.cast_transpose_dbias(dy, scale, out, out_t, scale_inv, amax, dbias)
                    elif op == "gelu_cast_transpose":
                        OPS.gelu_cast_transpose(x, scale, out, out_t, scale_inv, amax)
                    else:
                        OPS.dgelu_cast_transpose_dbias(dy, x, scale, out, out_t, scale_inv, amax,
                                                       dbias)  # fmt: skip
                    if op != "gelu_cast_transpose":
                        outs.append(dbias)
                    yield f"{op}/{hp}/{f8}/{shape}", outs


def _rope_cases(device, gen):
    for hp in HP:
        for b, s, heads, hd in [(2, 24, 2, 16), (1, 7, 3, 6), (1, 130, 4, 64), (2, 64, 2, 128)]:
            qkv = (torch.randn(b, s, 3 * heads * hd, generator=gen) * 4).to(hp).to(device)
            pos = torch.arange(s + 3, dtype=torch.float64)[:, None]
            inv = 500.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
            ang = torch.cat([pos * inv, pos * inv], dim=-1)
            cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
            for inverse in (False, True):
                out = torch.zeros_like(qkv)
                OPS.rope_qkv(qkv, cos, sin, heads, inverse, out)
                yield f"rope_qkv/{hp}/{(b, s, heads, hd)}/inverse={inverse}", [out]


def _scale_update_cases(device, gen):
    for length, slots in [(1, 5), (16, 100), (1024, 37), (1024, 3000)]:
        for most_recent in (False, True):
            h = torch.rand(length, slots, generator=gen) * 100
            h[0, ::3] = 0.0  # slots whose cast was skipped: nothing rolls
            h[0, 1::7] = math.inf
            h = h.to(device)
            scale = (torch.rand(slots, generator=gen) + 0.5).to(device)
            scaled_max = torch.full((slots,), 448.0, device=device)
            OPS.scale_update(h, scale, scaled_max, most_recent)
            yield f"scale_update/{length}x{slots}/most_recent={most_recent}", [h, scale]


def digests(device) -> dict[str, str]:
    gen = torch.Generator().manual_seed(20261130)
    result = {}
    for cases in (_cast_cases, _transpose_cases, _fused_cases, _rope_cases, _scale_update_cases):
        for name, outs in cases(device, gen):
            result[name] = _digest(outs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = digests(args.device)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(f"{len(result)} kernel output digests on {args.device}")


if __name__ == "__main__":
    main()
