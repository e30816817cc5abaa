"""Kernel benchmark: cast-transpose bandwidth against a device-to-device copy measured in the same
run, the fused cast-transposes (dbias, GELU, dGELU + dbias) and the fused-QKV RoPE against the
copy and against the unfused sequences they replace, the norms with an FP8 output and their
backward against the copy and torch's norm kernels (+ cast-transpose), and the fused scale
update against plain PyTorch ops."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from benchmarks.common import environment, graph_of, print_table, time_device
from benchmarks.kernel_times import kernel_stats
from graphfp8 import ops, reference

L2_BYTES = 60 * 2**20  # H200: rotate buffers so that one set never fits in L2


def _rotating(make, nbytes: int, device) -> list:
    """Buffer sets to cycle through: enough that one set never stays in a GPU's L2; two on the
    CPU (where the numbers only show that the benchmark runs)."""
    if torch.device(device).type != "cuda":
        return [make() for _ in range(2)]
    return [make() for _ in range(max(2, math.ceil(3 * L2_BYTES / nbytes)))]


def _timed(fn_i, n_sets: int, device) -> float:
    """ms per call of fn_i(i) cycling over n_sets buffer sets; CUDA graphs hide launch cost."""
    counter = iter(range(10**12))
    step = lambda: fn_i(next(counter) % n_sets)  # noqa: E731
    if torch.device(device).type == "cuda":
        calls = 4 * n_sets
        replay = graph_of(lambda: [fn_i(i) for i in range(n_sets)], calls // n_sets)
        return time_device(replay, device, iters=5) / calls
    return time_device(step, device, iters=3, repeats=3)


def _cast_transpose_row(device, m: int, n: int) -> dict:
    nbytes = 4 * m * n  # bf16 read (2 B) + FP8 out (1 B) + FP8 out_t (1 B) per element
    sets = _rotating(
        lambda: (
            torch.randn(m, n, device=device, dtype=torch.bfloat16),
            torch.empty(m, n, device=device, dtype=torch.float8_e4m3fn),
            torch.empty(n, m, device=device, dtype=torch.float8_e4m3fn),
            torch.empty(m, n, device=device, dtype=torch.bfloat16),
        ),
        nbytes,
        device,
    )
    scale, amax = torch.ones(1, device=device), torch.zeros(1, device=device)
    scale_inv = torch.empty(1, device=device)

    def cast_t(i):
        x, out, out_t, _ = sets[i]
        torch.ops.graphfp8.cast_transpose(x, scale, out, out_t, scale_inv, amax, None)

    def copy(i):
        sets[i][3].copy_(sets[i][0])  # bf16 -> bf16: 2 B read + 2 B written per element

    ms_ct = _timed(cast_t, len(sets), device)
    ms_copy = _timed(copy, len(sets), device)
    gbs_ct, gbs_copy = nbytes / ms_ct / 1e6, nbytes / ms_copy / 1e6
    return dict(
        shape=f"{m}x{n}",
        cast_transpose_ms=ms_ct,
        copy_ms=ms_copy,
        cast_transpose_GBps=gbs_ct,
        copy_GBps=gbs_copy,
        ratio_to_copy=gbs_ct / gbs_copy,
    )


# Each fused op: (bytes it moves per element, the fused call, the unfused sequence it replaces).
# bf16 in, FP8 out in both layouts: a bf16 read is 2 B, the two FP8 writes 1 B each.
def _fused_cases(scale, amax):
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

    def dbias_unfused(dy, x):
        ops.cast_transpose(dy, scale, amax, e5m2)
        return dy.sum(dim=0)

    def gelu_unfused(dy, x):
        return ops.cast_transpose(F.gelu(x, approximate="tanh"), scale, amax, e4m3)

    def dgelu_unfused(dy, x):
        dx = torch.ops.aten.gelu_backward(dy, x, approximate="tanh")
        ops.cast_transpose(dx, scale, amax, e5m2)
        return dx.sum(dim=0)

    return {
        "cast_transpose_dbias": (
            4, lambda dy, x: ops.cast_transpose_dbias(dy, scale, amax, e5m2), dbias_unfused),
        "gelu_cast_transpose": (
            4, lambda dy, x: ops.gelu_cast_transpose(x, scale, amax, e4m3), gelu_unfused),
        "dgelu_cast_transpose_dbias": (
            6, lambda dy, x: ops.dgelu_cast_transpose_dbias(dy, x, scale, amax, e5m2),
            dgelu_unfused),
    }  # fmt: skip


def _fused_rows(device, m: int, n: int, copy_gbs: float) -> list[dict]:
    """One row per fused op at (m, n): its GB/s, the ratio to the copy rate of the same run, and
    the time of the unfused sequence it replaces."""
    sets = _rotating(
        lambda: tuple(torch.randn(m, n, device=device, dtype=torch.bfloat16) for _ in range(2)),
        4 * m * n,
        device,
    )
    scale, amax = torch.ones(1, device=device), torch.zeros(1, device=device)
    rows = []
    for name, (bytes_per_elem, fused, unfused) in _fused_cases(scale, amax).items():
        ms = _timed(lambda i, f=fused: f(*sets[i]), len(sets), device)
        ms_unfused = _timed(lambda i, f=unfused: f(*sets[i]), len(sets), device)
        gbs = bytes_per_elem * m * n / ms / 1e6
        rows.append(dict(op=name, shape=f"{m}x{n}", fused_ms=ms, unfused_ms=ms_unfused,
                         GBps=gbs, ratio_to_copy=gbs / copy_gbs,
                         speedup=ms_unfused / ms))  # fmt: skip
    return rows


def _rope_torch_ops(qkv, cos, sin, heads: int):
    """The unfused baseline: RoPE as torch ops on the strided q/k views of the fused QKV."""
    b, s, width = qkv.shape
    q, k, v = qkv.view(b, s, 3, heads, width // (3 * heads)).unbind(dim=2)
    c, n = cos[:s, None, :].to(qkv.dtype), sin[:s, None, :].to(qkv.dtype)

    def rot(x):
        half = x.shape[-1] // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * n

    return rot(q), rot(k), v


def _rope_row(device, batch: int, seq: int, heads: int, head_dim: int, copy_gbs: float) -> dict:
    """rope_qkv on a (batch, seq, 3 * heads * head_dim) bf16 QKV against the copy rate and the
    torch-ops formulation it replaced in TransformerLayer."""
    from graphfp8.modules.transformer import rope_tables

    width = 3 * heads * head_dim
    nbytes = 4 * batch * seq * width  # bf16 read + bf16 written per element
    sets = _rotating(lambda: (torch.randn(batch, seq, width, device=device, dtype=torch.bfloat16),
                              torch.empty(batch, seq, width, device=device,
                                          dtype=torch.bfloat16)), nbytes, device)  # fmt: skip
    cos, sin = rope_tables(seq, head_dim, 10000.0, torch.float32, device)
    ms = _timed(lambda i: ops.rope_qkv(sets[i][0], cos, sin, heads, out=sets[i][1]), len(sets),
                device)  # fmt: skip
    ms_torch = _timed(lambda i: _rope_torch_ops(sets[i][0], cos, sin, heads), len(sets), device)
    gbs = nbytes / ms / 1e6
    return dict(op="rope_qkv", shape=f"{batch}x{seq}x{width}", fused_ms=ms, unfused_ms=ms_torch,
                GBps=gbs, ratio_to_copy=gbs / copy_gbs, speedup=ms_torch / ms)  # fmt: skip


def _norm_cases(m: int, n: int, device):
    """{name: (bytes per element, graphfp8 call, torch's unfused call)} for one buffer set
    (x, dy, gamma, beta, native_layer_norm's mean and rstd, the norm's mu and rsigma)."""
    e4m3, eps = torch.float8_e4m3fn, 1e-5
    scale, amax = torch.ones(1, device=device), torch.zeros(1, device=device)

    def ln_fwd(x, dy, g, b, *stats):
        return ops.layernorm_fp8(x, g, b, eps, scale, amax, e4m3, transpose=True)

    def ln_fwd_torch(x, dy, g, b, *stats):
        return ops.cast_transpose(F.layer_norm(x, (n,), g, b, eps), scale, amax, e4m3)

    def rms_fwd(x, dy, g, b, *stats):
        return ops.rmsnorm_fp8(x, g, eps, scale, amax, e4m3, transpose=True)

    def rms_fwd_torch(x, dy, g, b, *stats):
        return ops.cast_transpose(F.rms_norm(x, (n,), g, eps), scale, amax, e4m3)

    def ln_bwd(x, dy, g, b, mean, rstd, mu, rsigma):
        return ops.layernorm_bwd(dy, x, mu, rsigma, g)

    def ln_bwd_torch(x, dy, g, b, mean, rstd, mu, rsigma):
        return torch.ops.aten.native_layer_norm_backward(dy, x, [n], mean, rstd, g, b,
                                                         [True, True, True])  # fmt: skip

    # read x (2 B), write FP8 and its transpose (1 + 1 B); backward: read dy and x, write dx.
    return {
        "layernorm_fp8 (+ transpose)": (4, ln_fwd, ln_fwd_torch),
        "rmsnorm_fp8 (+ transpose)": (4, rms_fwd, rms_fwd_torch),
        "layernorm_bwd": (6, ln_bwd, ln_bwd_torch),
    }


def _norm_rows(device, m: int, n: int) -> list[dict]:
    """The norm kernels at (m rows, n hidden), bf16, against a copy of x timed in the same run
    and against torch's kernels (+ cast-transpose to FP8 for the forward)."""

    def make():
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        g = torch.randn(n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, device=device, dtype=torch.bfloat16)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [n], g, b, 1e-5)
        o = ops.layernorm_fp8(x, g, b, 1e-5, torch.ones(1, device=device),
                              torch.zeros(1, device=device), torch.float8_e4m3fn)  # fmt: skip
        return x, torch.randn_like(x), g, b, mean, rstd, o.mu, o.rsigma

    sets = _rotating(make, 6 * m * n, device)
    copies = [torch.empty_like(s[0]) for s in sets]
    ms_copy = _timed(lambda i: copies[i].copy_(sets[i][0]), len(sets), device)
    copy_gbs = 4 * m * n / ms_copy / 1e6
    rows = []
    for name, (bytes_per_elem, ours, theirs) in _norm_cases(m, n, device).items():
        ms = _timed(lambda i, f=ours: f(*sets[i]), len(sets), device)
        ms_torch = _timed(lambda i, f=theirs: f(*sets[i]), len(sets), device)
        gbs = bytes_per_elem * m * n / ms / 1e6
        rows.append(dict(op=name, shape=f"{m}x{n}", norm_ms=ms, GBps=gbs, copy_ms=ms_copy,
                         copy_GBps=copy_gbs, ratio_to_copy=gbs / copy_gbs, torch_ms=ms_torch,
                         speedup=ms_torch / ms))  # fmt: skip
    return rows


def _scale_update_row(device, slots: int, length: int) -> dict:
    history = torch.rand(length, slots, device=device) + 0.5
    scale = torch.ones(slots, device=device)
    scaled_max = torch.full((slots,), 448.0, device=device)
    fresh = torch.rand(slots, device=device) + 0.1

    def refill():
        history[0].copy_(fresh)  # a fresh amax per slot, so every slot rolls

    def fused():
        refill()
        torch.ops.graphfp8.scale_update(history, scale, scaled_max, False)

    def plain():
        refill()
        reference.scale_update(history, scale, scaled_max, False)

    row = dict(slots=slots, history=length)
    if torch.device(device).type == "cuda":
        upd = [v for k, v in kernel_stats(fused).items() if "scale_update" in k]
        row["fused_launches"] = sum(c for c, _ in upd)
        row["fused_gpu_us"] = sum(us for _, us in upd)
        plain_k, refill_k = kernel_stats(plain), kernel_stats(refill)
        row["plain_launches"] = sum(c for c, _ in plain_k.values()) - sum(
            c for c, _ in refill_k.values()
        )
        row["plain_gpu_us"] = sum(us for _, us in plain_k.values()) - sum(
            us for _, us in refill_k.values()
        )
    row["fused_eager_ms"] = time_device(fused, device)
    row["plain_eager_ms"] = time_device(plain, device)
    row["speedup_eager"] = row["plain_eager_ms"] / row["fused_eager_ms"]
    return row


def run(device, quick: bool = False) -> dict:
    """Every kernel table; quick: tiny shapes, a smoke run that CI does on the CPU in seconds."""
    shapes = [(256, 256)] if quick else [(4096, 4096), (8192, 8192)]
    slot_counts = [10, 100] if quick else [10, 100, 1000]
    history = 64 if quick else 1024
    ct = [_cast_transpose_row(device, m, n) for m, n in shapes]
    # The MLP block's activation (T, 4h) at h, T = 2048, 4096 (quick: a small one).
    fused_shapes = [(128, 256)] if quick else [(4096, 8192), (8192, 16384)]
    copy_gbs = ct[-1]["copy_GBps"]
    fused = [row for m, n in fused_shapes for row in _fused_rows(device, m, n, copy_gbs)]
    rope_shape = (2, 64, 2, 32) if quick else (8, 1024, 16, 64)  # the 100m preset's QKV
    fused.append(_rope_row(device, *rope_shape, copy_gbs))
    norm_shapes = [(64, 256)] if quick else [(8192, 4096), (16384, 8192)]
    norms = [row for m, n in norm_shapes for row in _norm_rows(device, m, n)]
    up = [_scale_update_row(device, slots, history) for slots in slot_counts]
    text = print_table(
        f"cast-transpose (bf16 -> E4M3, both layouts) vs copy, {device}",
        ["shape", "cast-transpose ms", "GB/s", "copy GB/s", "ratio to copy"],
        [
            [
                r["shape"],
                r["cast_transpose_ms"],
                r["cast_transpose_GBps"],
                r["copy_GBps"],
                r["ratio_to_copy"],
            ]
            for r in ct
        ],
    )
    text += print_table(
        f"fused kernels (cast-transposes bf16 -> FP8 both layouts; RoPE) vs copy and unfused, "
        f"{device}",
        ["op", "shape", "fused ms", "GB/s", "ratio to copy", "unfused ms", "speedup"],
        [[r["op"], r["shape"], r["fused_ms"], r["GBps"], r["ratio_to_copy"], r["unfused_ms"],
          r["speedup"]] for r in fused],
    )  # fmt: skip
    text += print_table(
        f"norms, bf16 -> E4M3 (forward: both FP8 layouts) vs copy and torch's kernels, {device}",
        ["op", "shape", "ms", "GB/s", "copy GB/s", "ratio to copy", "torch ms", "speedup"],
        [[r["op"], r["shape"], r["norm_ms"], r["GBps"], r["copy_GBps"], r["ratio_to_copy"],
          r["torch_ms"], r["speedup"]] for r in norms],
    )  # fmt: skip
    header = ["slots", "history", "fused eager ms", "plain eager ms", "speedup"]
    keys = ["slots", "history", "fused_eager_ms", "plain_eager_ms", "speedup_eager"]
    if torch.device(device).type == "cuda":
        header += ["fused launches", "fused GPU us", "plain launches", "plain GPU us"]
        keys += ["fused_launches", "fused_gpu_us", "plain_launches", "plain_gpu_us"]
    text += print_table(
        f"fused scale update vs plain PyTorch ops, {device}",
        header,
        [[r[k] for k in keys] for r in up],
    )
    return {"env": environment(device), "cast_transpose": ct, "fused": fused, "norm": norms,
            "scale_update": up, "table": text}  # fmt: skip
