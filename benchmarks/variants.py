"""Kernel variants in one run (issue 22): each default-off kernel switch (graphfp8.ops.switches)
off and on, and current scaling's two launch sequences per cast against the delayed-scaling cast,
all against a copy timed in the same run. On the GPU this is what decides whether a switch
becomes the default; the CUDA tests decide whether it may (bit-identical results)."""

from __future__ import annotations

import torch

from benchmarks.common import env_var, environment, print_table
from benchmarks.kernels import _rotating, _timed
from graphfp8 import ops
from graphfp8.fp8 import current
from graphfp8.fp8.current import CurrentQuantizer
from graphfp8.fp8.slots import Quantizer
from graphfp8.graphs import grads
from graphfp8.modules.layernorm_mlp import ACTIVATIONS
from graphfp8.ops.switches import kernel_switch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bf16_sets(m: int, n: int, device, k: int = 2):
    return _rotating(
        lambda: tuple(torch.randn(m, n, device=device, dtype=torch.bfloat16) for _ in range(k)),
        2 * k * m * n,
        device,
    )


def _copy_gbs(sets, device) -> float:
    """GB/s of a bf16 device copy (read + write) of the sets' first tensors."""
    dst = [torch.empty_like(s[0]) for s in sets]
    ms = _timed(lambda i: dst[i].copy_(sets[i][0]), len(sets), device)
    return 2 * 2 * sets[0][0].numel() / ms / 1e6


def _switch_row(name, op, shape, bytes_per_elem, fn, sets, copy_gbs, device) -> dict:
    """fn(*set) with the switch `name` off and on: ms, GB/s ratio to copy, speed-up."""
    n_elem = shape[0] * shape[1]
    ms = {}
    for on in (False, True):
        with kernel_switch(name, on):
            ms[on] = _timed(lambda i: fn(*sets[i]), len(sets), device)
    ratio = {on: bytes_per_elem * n_elem / ms[on] / 1e6 / copy_gbs for on in ms}
    return dict(switch=name, op=op, shape=f"{shape[0]}x{shape[1]}", off_ms=ms[False],
                on_ms=ms[True], off_ratio_to_copy=ratio[False], on_ratio_to_copy=ratio[True],
                speedup=ms[False] / ms[True])  # fmt: skip


def switch_table(title: str, rows: list[dict]) -> str:
    """The _switch_row rows printed as one table under `title`; returns its text."""
    return print_table(
        title,
        ["switch", "op", "shape", "off ms", "on ms", "off / copy", "on / copy", "speedup"],
        [[r["switch"], r["op"], r["shape"], r["off_ms"], r["on_ms"], r["off_ratio_to_copy"],
          r["on_ratio_to_copy"], r["speedup"]] for r in rows],
    )  # fmt: skip


# The four GEMM weights of one layer (out, in) at Llama-3.2-1B and Llama-3-8B (issue 41)
LAYER_WEIGHTS = {
    "llama-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "llama-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}


def _grad_fill_row(layer: str, shapes, copy_gbs, device) -> dict:
    """The -0.0 fill of one layer's bf16 .grad buffers (graphs/grads.py) with GRAD_FILL_ONE_PASS
    off (zero + negate: 6 B per element) and on (fill_: 2 B), captured in the same process; each
    variant's own bytes against the copy rate."""
    buffers = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in shapes]
    n_elem = sum(b.numel() for b in buffers)
    ms = {}
    for on in (False, True):
        # read while _timed captures
        with env_var("GRAPHFP8_GRAD_FILL_ONE_PASS", "1" if on else "0"):
            ms[on] = _timed(lambda i: grads.fill_minus_zero(buffers), 1, device)
    ratio = {on: (2 if on else 6) * n_elem / ms[on] / 1e6 / copy_gbs for on in ms}
    return dict(switch="GRAD_FILL_ONE_PASS", op=f"-0.0 fill, {layer} layer", shape=f"{n_elem}",
                off_ms=ms[False], on_ms=ms[True], off_ratio_to_copy=ratio[False],
                on_ratio_to_copy=ratio[True], speedup=ms[False] / ms[True])  # fmt: skip


def _copy_first_row(layer: str, shapes, copy_gbs, device) -> dict:
    """The first microbatch's gradient accumulation of one layer's bf16 weights: off, the -0.0
    fill (zero + negate) and the add of each gradient (12 B per element); on, grad_fold_ with its
    flag set (GRAD_FOLD_COPY_FIRST: 4 B). Each variant's own bytes against the copy rate."""
    buffers = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in shapes]
    grads_ = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]
    first = torch.ones(1, dtype=torch.int32, device=device)
    n_elem = sum(b.numel() for b in buffers)

    def off(i):
        with env_var("GRAPHFP8_GRAD_FILL_ONE_PASS", "0"):
            grads.fill_minus_zero(buffers)
        for b, g in zip(buffers, grads_, strict=True):  # as GradFold folds a large gradient
            b.add_(g)

    def on(i):
        for b, g in zip(buffers, grads_, strict=True):
            ops.grad_fold_(b, g, first)

    ms = {False: _timed(off, 1, device), True: _timed(on, 1, device)}
    ratio = {k: (4 if k else 12) * n_elem / ms[k] / 1e6 / copy_gbs for k in ms}
    return dict(switch="GRAD_FOLD_COPY_FIRST", op=f"first fold, {layer} layer",
                shape=f"{n_elem}", off_ms=ms[False], on_ms=ms[True],
                off_ratio_to_copy=ratio[False], on_ratio_to_copy=ratio[True],
                speedup=ms[False] / ms[True])  # fmt: skip


def _cast_cases(device):
    one, amax = torch.ones(1, device=device), torch.zeros(1, device=device)
    return {
        "cast_transpose": (4, lambda dy, x: ops.cast_transpose(x, one, amax, E4M3)),
        "cast_transpose_dbias": (4, lambda dy, x: ops.cast_transpose_dbias(dy, one, amax, E5M2)),
        "gelu_cast_transpose": (4, lambda dy, x: ops.gelu_cast_transpose(x, one, amax, E4M3)),
        "dgelu_cast_transpose_dbias": (
            6, lambda dy, x: ops.dgelu_cast_transpose_dbias(dy, x, one, amax, E5M2)),
    }  # fmt: skip


def _norm_bwd(dy, x, g, mu, rsigma):
    return ops.layernorm_bwd(dy, x, mu, rsigma, g)


def _norm_bwd_res(dy, x, g, mu, rsigma):
    """As in a TransformerLayer: the residual's gradient added (x stands in for it: 2 B more)."""
    return ops.layernorm_bwd(dy, x, mu, rsigma, g, dresidual=x)


def _rms_bwd(dy, x, g, mu, rsigma):
    return ops.rmsnorm_bwd(dy, x, rsigma, g)


def _rms_bwd_res(dy, x, g, mu, rsigma):
    return ops.rmsnorm_bwd(dy, x, rsigma, g, dresidual=x)


# issue 41 cut 4: the v2 norm backward at Llama-1B's and Llama-8B's norm shapes (B2 x S2048 and
# B2 x S4096 rows at h2048, B1 x S8192 at h4096); bytes: dy, x read, dx written (+ dresidual)
NORM_BWD_V2_SHAPES = [(4096, 2048), (8192, 2048), (8192, 4096)]
NORM_BWD_V2_CASES = [("rmsnorm_bwd", 6, _rms_bwd), ("rmsnorm_bwd + dresidual", 8, _rms_bwd_res),
                     ("layernorm_bwd", 6, _norm_bwd),
                     ("layernorm_bwd + dresidual", 8, _norm_bwd_res)]  # fmt: skip


def _norm_bwd_v2_rows(device, quick: bool) -> list[dict]:
    """NORM_BWD_V2 off (the batched kernel, the default) and on, each case at each shape."""
    rows = []
    for shape in [(64, 256)] if quick else NORM_BWD_V2_SHAPES:
        sets = _norm_sets(*shape, device)
        copy_gbs = _copy_gbs(sets, device)
        rows += [_switch_row("NORM_BWD_V2", op, shape, nbytes, fn, sets, copy_gbs, device)
                 for op, nbytes, fn in NORM_BWD_V2_CASES]  # fmt: skip
    return rows


def _norm_fwd_t(dy, x, g, mu, rsigma):
    """As in a LayerNormLinear under training: the FP8 rows and their transpose (the norm's
    bytes: x read, 2 B; both FP8 layouts written, 2 B)."""
    one, amax = torch.ones(1, device=x.device), torch.zeros(1, device=x.device)
    return ops.layernorm_fp8(x, g, g, 1e-5, one, amax, E4M3, transpose=True)


def _blockwise_norm_row(shape, sets, copy_gbs, device) -> dict:
    """GRAPHFP8_BLOCKWISE_NORM off (torch's LayerNorm, then the fused blockwise quantizer of its
    bf16 output: both 1x128 layouts) and on (graphfp8.ops.blockwise_norm: the norm writes them),
    as _switch_row reports a kernel switch (the norm's bytes: x read, both FP8 layouts written)."""

    def off(dy, x, g, mu, rsigma):
        y = torch.nn.functional.layer_norm(x, x.shape[-1:], g, g, 1e-5)
        return ops.blockwise_quantize(y, 1, transpose=True)

    def on(dy, x, g, mu, rsigma):
        return ops.blockwise_norm(x, g, g, 1e-5, transpose=True)

    ms = {k: _timed(lambda i, f=f: f(*sets[i]), len(sets), device) for k, f in ((0, off), (1, on))}
    ratio = {k: 4 * shape[0] * shape[1] / v / 1e6 / copy_gbs for k, v in ms.items()}
    return dict(switch="BLOCKWISE_NORM", op="layernorm -> 1x128 tiles + y.T tiles",
                shape=f"{shape[0]}x{shape[1]}", off_ms=ms[0], on_ms=ms[1],
                off_ratio_to_copy=ratio[0], on_ratio_to_copy=ratio[1],
                speedup=ms[0] / ms[1])  # fmt: skip


def _blockwise_act_row(activation: str, shape, sets, copy_gbs, device) -> dict:
    """GRAPHFP8_BLOCKWISE_ACT off (torch's activation as LayerNormMLP runs it, then the fused
    blockwise quantizer of its bf16 output: both 1x128 layouts) and on (graphfp8.ops.blockwise_act:
    the activation writes them), as _switch_row reports a kernel switch. x (m, n) is the
    activation's input ([g | u] for SwiGLU); the bytes per element of a: x read (2 B, SwiGLU 4)
    and both FP8 layouts written (2 B)."""
    act = ACTIVATIONS[activation]

    def off(dy, x):
        return ops.blockwise_quantize(act(x), 1, transpose=True)

    def on(dy, x):
        return ops.blockwise_act(x, activation, transpose=True)

    ms = {k: _timed(lambda i, f=f: f(*sets[i]), len(sets), device) for k, f in ((0, off), (1, on))}
    gated = activation != "gelu"
    n_elem, nbytes = shape[0] * shape[1] // (2 if gated else 1), 6 if gated else 4
    ratio = {k: nbytes * n_elem / v / 1e6 / copy_gbs for k, v in ms.items()}
    return dict(switch="BLOCKWISE_ACT", op=f"{activation} -> 1x128 tiles + a.T tiles",
                shape=f"{shape[0]}x{shape[1]}", off_ms=ms[0], on_ms=ms[1],
                off_ratio_to_copy=ratio[0], on_ratio_to_copy=ratio[1],
                speedup=ms[0] / ms[1])  # fmt: skip


# issue 42: the Llama-1B SwiGLU MLP's blockwise operands (h 2048, F 8192, 4096 tokens)
BLOCK_QUANTIZE_SHAPES = [(4096, 2048), (4096, 8192), (4096, 16384)]


def _block_quantize_row(m: int, n: int, device) -> dict:
    """One shape of block_quantize_rows: ms, GB/s and the ratio to a bf16 copy, of the default
    kernel and (staged_*) of BLOCK_QUANTIZE_STAGED's, timed on the same tensors."""

    def make():
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        return x, ops.blockwise_quantize(x, 1, transpose=True)

    sets = _rotating(make, 4 * m * n, device)
    copy_gbs = _copy_gbs(sets, device)

    def quantize(i):
        ops.blockwise_quantize(sets[i][0], 1, transpose=True, out=sets[i][1])

    nbytes = 4 * m * n + 4 * (m * -(-n // 128) + n * -(-m // 128))
    ms = {}
    for staged in (False, True):
        with kernel_switch("BLOCK_QUANTIZE_STAGED", staged):
            ms[staged] = _timed(quantize, len(sets), device)
    gbs = {k: nbytes / v / 1e6 for k, v in ms.items()}
    return dict(op="blockwise_quantize 1x128 + x.T tiles", shape=f"{m}x{n}", ms=ms[False],
                us=1e3 * ms[False], GBps=gbs[False], copy_GBps=copy_gbs,
                ratio_to_copy=gbs[False] / copy_gbs, staged_us=1e3 * ms[True],
                staged_ratio_to_copy=gbs[True] / copy_gbs)  # fmt: skip


def block_quantize_rows(device, quick: bool = False) -> list[dict]:
    """graphfp8.blockwise_quantize's 1x128 tiles of a bf16 x and of x.T (E4M3, the recipe's
    activation and gradient quantizer) at the MLP's shapes, against a bf16 copy of the same
    tensors timed in the same run: bytes are x read, both FP8 layouts and their scales written.
    Each shape with the kernel switch BLOCK_QUANTIZE_STAGED off and on."""
    shapes = [(256, 384)] if quick else BLOCK_QUANTIZE_SHAPES
    return [_block_quantize_row(m, n, device) for m, n in shapes]


def block_quantize_table(rows: list[dict], device) -> str:
    """The rows of block_quantize_rows as a table, with the total of one MLP microbatch (x and
    dy at the first shape, one launch at each of the others) for both kernels."""

    def total(key):
        return sum(r[key] for r in rows) + (rows[0][key] if len(rows) == 3 else 0.0)

    return print_table(
        f"blockwise quantize, bf16 -> E4M3 tiles of x and x.T (ratios to a bf16 copy, same run), "
        f"{device}; one MLP microbatch's four launches: {total('us'):.1f} us, "
        f"{total('staged_us'):.1f} us staged (BLOCK_QUANTIZE_STAGED)",
        ["op", "shape", "us", "GB/s", "copy GB/s", "/ copy", "staged us", "staged / copy"],
        [[r["op"], r["shape"], r["us"], r["GBps"], r["copy_GBps"], r["ratio_to_copy"],
          r["staged_us"], r["staged_ratio_to_copy"]] for r in rows],
    )  # fmt: skip


def _norm_sets(m: int, n: int, device):
    def make():
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        g = torch.randn(n, device=device, dtype=torch.bfloat16)
        o = ops.layernorm_fp8(x, g, torch.zeros_like(g), 1e-5, torch.ones(1, device=device),
                              torch.zeros(1, device=device), E4M3)  # fmt: skip
        return torch.randn_like(x), x, g, o.mu, o.rsigma

    return _rotating(make, 6 * m * n, device)


def _current_row(op: str, shape, sets, device) -> dict:
    """ms per cast: delayed scaling (the cast alone), the three-launch and the fused current
    scaling sequences (graphfp8/fp8/current.py), on a one-slot history."""
    h0, scale = torch.zeros(1, device=device), torch.ones(1, device=device)
    scaled_max, sink = torch.tensor([448.0], device=device), torch.zeros(1, device=device)
    cast = {"cast_transpose": lambda x, q: ops.cast_transpose(x, *q),
            "gelu_cast_transpose": lambda x, q: ops.gelu_cast_transpose(x, *q)}[op]  # fmt: skip
    amax_of = current.amax_of if op == "cast_transpose" else current.gelu_amax_of

    def delayed(dy, x):
        cast(x, Quantizer(scale, h0, E4M3))

    def three(dy, x):
        with _fused(False):
            amax_of(x)(Quantizer(scale, h0, E4M3))
        ops.scale_update_(h0.view(1, 1), scale, scaled_max, True)
        cast(x, Quantizer(scale, sink, E4M3))

    def fused(dy, x):
        with _fused(True):
            amax_of(x)(CurrentQuantizer(scale, h0, E4M3, scaled_max))
        cast(x, CurrentQuantizer(scale, h0, E4M3, scaled_max))

    ms = {k: _timed(lambda i, f=f: f(*sets[i]), len(sets), device)
          for k, f in (("delayed", delayed), ("three", three), ("fused", fused))}  # fmt: skip
    return dict(op=op, shape=f"{shape[0]}x{shape[1]}", delayed_ms=ms["delayed"],
                three_launch_ms=ms["three"], fused_ms=ms["fused"],
                three_vs_delayed=ms["three"] / ms["delayed"],
                fused_vs_delayed=ms["fused"] / ms["delayed"])  # fmt: skip


class _fused:
    """Sets graphfp8.fp8.current's path for the tensors of this benchmark's device."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.before = (current.FUSED_ON_CPU, current.FUSED_ON_CUDA)
        current.FUSED_ON_CPU = current.FUSED_ON_CUDA = self.on

    def __exit__(self, *exc):
        current.FUSED_ON_CPU, current.FUSED_ON_CUDA = self.before


def run(device, quick: bool = False) -> dict:
    """The variant tables; quick: tiny shapes (a CPU smoke run: there the switches do nothing)."""
    cast_shapes = [(128, 256)] if quick else [(4096, 8192), (8192, 16384)]
    norm_shapes = [(64, 256)] if quick else [(8192, 1024), (8192, 4096), (16384, 8192)]
    switches, cur = [], []
    for shape in cast_shapes:
        sets = _bf16_sets(*shape, device)
        copy_gbs = _copy_gbs(sets, device)
        for op, (nbytes, fn) in _cast_cases(device).items():
            switches.append(_switch_row("PAIRED_QUANTIZE", op, shape, nbytes, fn, sets,
                                        copy_gbs, device))  # fmt: skip
            if "dbias" in op:  # issue 33: the dbias sums without a second launch
                switches.append(_switch_row("DBIAS_IN_KERNEL", op, shape, nbytes, fn, sets,
                                            copy_gbs, device))  # fmt: skip
        cur += [_current_row(op, shape, sets, device)
                for op in ("cast_transpose", "gelu_cast_transpose")]  # fmt: skip
        for activation in ("gelu", "swiglu"):  # issue 42: the activation writes fc2's tiles
            switches.append(_blockwise_act_row(activation, shape, sets, copy_gbs, device))
    for shape in norm_shapes:
        sets = _norm_sets(*shape, device)
        copy_gbs = _copy_gbs(sets, device)
        switches.append(_switch_row("NORM_BWD_BATCHED", "layernorm_bwd", shape, 6, _norm_bwd,
                                    sets, copy_gbs, device))  # fmt: skip
        # issue 41: the transpose written by the norm kernel, not a second pass
        switches.append(_switch_row("NORM_FWD_TRANSPOSE", "layernorm_fp8 + out_t", shape, 4,
                                    _norm_fwd_t, sets, copy_gbs, device))  # fmt: skip
        # issue 42: the norm writes the blockwise GEMM's tiles (modules/_blockwise_norm.py)
        switches.append(_blockwise_norm_row(shape, sets, copy_gbs, device))
        with kernel_switch("NORM_BWD_BATCHED", True):  # issue 33: its staged variant
            switches.append(_switch_row("NORM_BWD_STAGED", "layernorm_bwd", shape, 6,
                                        _norm_bwd, sets, copy_gbs, device))  # fmt: skip
            switches.append(_switch_row("NORM_BWD_STAGED", "layernorm_bwd + dresidual",
                                        shape, 8, _norm_bwd_res, sets, copy_gbs,
                                        device))  # fmt: skip
            with kernel_switch("NORM_BWD_STAGED", True):
                switches.append(_switch_row("NORM_BWD_PARAM_IN_KERNEL", "layernorm_bwd", shape,
                                            6, _norm_bwd, sets, copy_gbs, device))  # fmt: skip
    switches += _norm_bwd_v2_rows(device, quick)
    # issue 41: the .grad buffers' -0.0 fill of layer graphs in one pass (notes/PERF.md)
    layers = {"tiny": [(256, 256), (64, 32)]} if quick else LAYER_WEIGHTS  # one >= FOLD_AT_ONCE
    copy_gbs = _copy_gbs(_bf16_sets(*norm_shapes[-1], device), device)
    switches += [_grad_fill_row(k, v, copy_gbs, device) for k, v in layers.items()]
    switches += [_copy_first_row(k, v, copy_gbs, device) for k, v in layers.items()]
    text = switch_table(
        f"kernel switches off / on, bf16 (same run; ratios to a bf16 copy), {device}", switches
    )
    text += print_table(
        f"current scaling per cast: three launches vs fused, against the delayed cast, {device}",
        ["op", "shape", "delayed ms", "three-launch ms", "fused ms", "three / delayed",
         "fused / delayed"],
        [[r["op"], r["shape"], r["delayed_ms"], r["three_launch_ms"], r["fused_ms"],
          r["three_vs_delayed"], r["fused_vs_delayed"]] for r in cur],
    )  # fmt: skip
    block = block_quantize_rows(device, quick)
    text += block_quantize_table(block, device)
    return {"env": environment(device), "switches": switches, "current": cur,
            "block_quantize": block, "table": text}  # fmt: skip
