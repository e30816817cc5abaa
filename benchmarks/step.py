"""Step benchmark: the whole training step as one graph against per-layer graphs and bf16 graphs,
every peer in one process - time per microbatch, host enqueue time per optimizer step, GPU busy
fraction and kernels per step; then host time per step against the layer count.

Each peer runs one optimizer step of MICROBATCHES microbatches of the MLP block stack (residual
graphfp8 LayerNormMLP blocks, or torch's for bf16 torch graphs): forward, loss (sum(y * dy) / N),
backward, gradient accumulation, clipping to norm 1.0, fused AdamW, zero_grad:

    fp8 step graph      graphs.make_graphed_step, FP8: one replay per step
    fp8 layer graphs    make_graphed_callables of the stack (FP8); loss, backward through the
                        autograd engine, clipping and AdamW eager
    bf16 step graph     graphs.make_graphed_step with FP8 off
    bf16 torch graphs   torch.cuda.make_graphed_callables of the torch block; the rest eager (GPU)
    TE layer graphs     TransformerEngine's LayerNormMLP stack through its make_graphed_callables
                        (one stream: benchmarks/te_peers.py); loss, backward, clipping and AdamW
                        eager, as "fp8 layer graphs" (GPU, where TE imports)

    python -m benchmarks step [--quick] [--json PATH]   (--quick: small shapes, CPU too)
"""

from __future__ import annotations

import copy

import torch

import graphfp8 as g8
from benchmarks.common import environment, print_table, time_device, time_host
from benchmarks.peers import RECIPE, G8Stack, TorchMLP
from benchmarks.te_peers import TEMLPStack, same_stream_graphed, te, te_recipe, try_build

MICROBATCHES = 4  # per optimizer step (2 with --quick)
MAX_GRAD_NORM = 1.0


def _loss(y, dy):
    return torch.sum(y * dy, dtype=torch.float32)


def _adamw(model, device, captured: bool):
    kind = dict(fused=True)
    if captured and torch.device(device).type == "cuda":
        kind["capturable"] = True
    lr = torch.tensor(1e-4, device=device)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, **kind)


def _data(n: int, hidden: int, tokens: int, device):
    x = torch.randn(n, tokens, hidden, dtype=torch.bfloat16, device=device)
    return x, torch.randn_like(x)


def _step_graph(model, x, dy, fp8: bool):
    opt = _adamw(model, x.device, captured=True)
    warmup = 3 if x.device.type == "cuda" else 1
    step = g8.make_graphed_step(model, _loss, opt, (x, dy), len(x), fp8_enabled=fp8,
                                fp8_recipe=RECIPE, max_grad_norm=MAX_GRAD_NORM,
                                num_warmup_iters=warmup)  # fmt: skip
    batch = (x, dy)
    run = lambda: step(batch)  # noqa: E731
    run.launch_only = step.launch_only  # the host cost without the per-call checks
    return run


def _eager_tail(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _layer_graphs(model, x, dy):
    opt = _adamw(model, x.device, captured=False)
    graphed = g8.make_graphed_callables(model, (x[0],), fp8_enabled=True, fp8_recipe=RECIPE,
                                        fp8_weight_caching=True)  # fmt: skip

    def step():
        for i in range(len(x)):
            y = graphed(x[i], is_first_microbatch=i == 0)
            (_loss(y, dy[i]) / len(x)).backward()
        _eager_tail(model, opt)

    return step


def _torch_graphs(model, x, dy):
    opt = _adamw(model, x.device, captured=False)
    graphed = torch.cuda.make_graphed_callables(model, (x[0],))

    def step():
        for i in range(len(x)):
            (_loss(graphed(x[i]), dy[i]) / len(x)).backward()
        _eager_tail(model, opt)

    return step


def _te_layer_graphs(ref, x, dy):
    """TE's peer of "fp8 layer graphs": the same weights in te.LayerNormMLP blocks."""
    model = TEMLPStack(ref.blocks[0].hidden_size, len(ref.blocks))
    model.load_state_dict({k: v for k, v in ref.state_dict().items() if "_extra_state" not in k},
                          strict=False)  # fmt: skip
    opt = _adamw(model, x.device, captured=False)
    recipe = te_recipe()
    graphed = same_stream_graphed(model, (x[0],), fp8_enabled=True, fp8_recipe=recipe,
                                  fp8_weight_caching=True)  # fmt: skip

    def step():
        for i in range(len(x)):
            with te().fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = graphed(x[i], is_first_microbatch=i == 0)
            (_loss(y, dy[i]) / len(x)).backward()
        _eager_tail(model, opt)

    return step


def make_peers(n: int, hidden: int, tokens: int, layers: int, device, bf16: bool = True) -> dict:
    """{name: step()} of n microbatches, on the same weights and data."""
    torch.manual_seed(0)
    ref = G8Stack(hidden, layers, device=device)
    x, dy = _data(n, hidden, tokens, device)
    peers = {
        "fp8 step graph": _step_graph(copy.deepcopy(ref), x, dy, fp8=True),
        "fp8 layer graphs": _layer_graphs(copy.deepcopy(ref), x, dy),
    }
    if bf16:
        peers["bf16 step graph"] = _step_graph(copy.deepcopy(ref), x, dy, fp8=False)
        if torch.device(device).type == "cuda" and layers == 1:
            peers["bf16 torch graphs"] = _torch_graphs(TorchMLP(hidden), x, dy)
    if bf16 and torch.device(device).type == "cuda" and te() is not None:
        failures: dict = {}
        step = try_build("TE layer graphs", lambda: _te_layer_graphs(ref, x, dy), failures)
        if step is not None:
            peers["TE layer graphs"] = step
        for name, err in failures.items():
            print(f"{name} failed to build: {err}")
    return peers


def _measure(step, n: int, device, quick: bool) -> dict:
    """Per optimizer step: device ms (back to back), host ms, kernels, GPU busy fraction."""
    iters, repeats = (1, 1) if quick else (20, 3)
    row = {
        "device_ms": time_device(step, device, warmup=1, iters=iters, repeats=repeats),
        "host_ms": time_host(step, device, warmup=1, iters=iters, repeats=repeats),
    }
    launch = getattr(step, "launch_only", None)
    row["launch_host_ms"] = (
        time_host(launch, device, warmup=1, iters=iters, repeats=repeats) if launch else None
    )
    row["ms_per_microbatch"] = row["device_ms"] / n
    row["kernels"] = row["busy"] = None
    if torch.device(device).type == "cuda":
        from benchmarks.kernel_times import kernel_stats

        stats = kernel_stats(step, iters=3)
        row["kernels"] = sum(c for c, _ in stats.values())
        row["busy"] = min(1.0, sum(us for _, us in stats.values()) / 1e3 / row["device_ms"])
    return row


def run(device, quick: bool = False) -> dict:
    cuda = torch.device(device).type == "cuda"
    n, hidden, tokens = (2, 32, 32) if quick else (MICROBATCHES, 1024, 2048)
    counts = (1, 2) if quick else (1, 8, 24)
    block = {name: _measure(step, n, device, quick)
             for name, step in make_peers(n, hidden, tokens, 1, device).items()}  # fmt: skip
    floor_ms = None
    if cuda:
        from benchmarks.block import fp8_gemm_tflops

        floor_ms = 48 * tokens * hidden**2 / (fp8_gemm_tflops() * 1e9)
    layers = []
    for count in counts:
        peers = make_peers(n, hidden, tokens, count, device, bf16=False)
        layers.append({"layers": count, **{k: _measure(s, n, device, quick)
                                           for k, s in peers.items()}})  # fmt: skip
        del peers
        if cuda:
            torch.cuda.empty_cache()
    text = _tables(n, hidden, tokens, block, layers, floor_ms)
    return {"env": environment(device), "hidden": hidden, "tokens": tokens,
            "microbatches": n, "floor_ms_per_microbatch": floor_ms, "block": block,
            "layers": layers, "table": text}  # fmt: skip


def _fmt(v):
    return "-" if v is None else v


def _tables(n, hidden, tokens, block, layers, floor_ms) -> str:
    title = (f"MLP block h={hidden} T={tokens}, {n} microbatches per optimizer step "
             "(clip + fused AdamW): per peer")  # fmt: skip
    header = ["peer", "ms / microbatch", "host ms / step", "device ms / step", "kernels / step",
              "GPU busy"]  # fmt: skip
    rows = [[name, r["ms_per_microbatch"], r["host_ms"], r["device_ms"], _fmt(r["kernels"]),
             _fmt(r["busy"])] for name, r in block.items()]  # fmt: skip
    if floor_ms is not None:
        rows.append(["FP8 GEMM floor", floor_ms, "-", "-", "-", "-"])
    text = print_table(title, header, rows)
    base = block["fp8 layer graphs"]
    step = block["fp8 step graph"]
    text += print_table(
        "fp8 step graph relative to fp8 layer graphs (< 1 is faster)",
        ["ms / microbatch", "host ms / step"],
        [
            [
                step["ms_per_microbatch"] / base["ms_per_microbatch"],
                step["host_ms"] / base["host_ms"],
            ]
        ],
    )
    text += print_table(
        f"host ms per optimizer step vs layers (h={hidden}, T={tokens}, {n} "
        "microbatches)",
        ["layers", "step graph host ms", "of which launch", "layer graphs host ms",
         "step graph device ms", "layer graphs device ms", "step graph busy"],
        [[r["layers"], r["fp8 step graph"]["host_ms"], r["fp8 step graph"]["launch_host_ms"],
          r["fp8 layer graphs"]["host_ms"],
          r["fp8 step graph"]["device_ms"], r["fp8 layer graphs"]["device_ms"],
          _fmt(r["fp8 step graph"]["busy"])] for r in layers],
    )  # fmt: skip
    return text
