"""Graph nodes per TransformerLayer per microbatch in the step graph (issue 33: at most 30; the
100m profile counted ~58): the step graph of the training GPT (graphfp8.training.model) with one
and with two layers, M microbatches each, and what the second layer adds divided by M.

On the CPU the replay tape's dispatcher ops are counted as CUDA kernels the way `opcount`
counts them (views and allocations launch nothing; graphfp8 ops that launch two kernels count
twice) and copy_ / fill_ / zero_ as what would be memcpy / memset nodes. On a GPU the CUDA
graph's own nodes are counted too, by type (kernel, memset, memcpy) and by kernel name, and one
eager microbatch under torch.profiler names the op that launched each memset / memcpy (cuDNN and
cuBLAS launch some inside their calls, which no dispatcher op shows).
"""

from __future__ import annotations

import collections

import torch

import graphfp8 as g8
from benchmarks.common import environment, print_table
from benchmarks.opcount import kernels
from graphfp8.training.model import GPT, ModelConfig

# Dispatcher ops that a GPU runs as a memcpy or memset node (or a fill kernel).
MEMOPS = {"aten::copy_", "aten::fill_", "aten::zero_", "aten::_foreach_copy_", "aten::zeros",
          "aten::zeros_like", "aten::clone", "aten::_to_copy", "aten::contiguous"}  # fmt: skip


def model_config(device, quick: bool) -> ModelConfig:
    """The 100m preset's layer on a GPU; a tiny one on the CPU (the op list does not depend on
    the sizes)."""
    if torch.device(device).type == "cuda" and not quick:
        return ModelConfig(hidden=1024, heads=16, ffn=4096, layers=1, seq_len=1024, batch=8,
                           lr=6e-4)  # fmt: skip
    return ModelConfig(hidden=64, heads=4, ffn=256, layers=1, seq_len=32, batch=2, lr=1e-3)


def step_graph(cfg: ModelConfig, layers: int, microbatches: int, fp8: bool, device):
    """make_graphed_step of a GPT with `layers` layers, as graphfp8-train --graphs step does."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**cfg.__dict__, "layers": layers})
    model = GPT(cfg, device=device)
    cuda = torch.device(device).type == "cuda"
    lr = torch.tensor(cfg.lr, device=device) if cuda else torch.tensor(cfg.lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=cuda)
    tokens = torch.zeros(microbatches, cfg.batch, cfg.seq_len, dtype=torch.int64, device=device)
    return g8.make_graphed_step(
        model, None, opt, ((tokens, tokens.clone()), ()), microbatches, fp8_enabled=fp8,
        fp8_recipe=g8.DelayedScaling() if fp8 else None, fp8_weight_caching=fp8,
        max_grad_norm=1.0, num_warmup_iters=3 if cuda else 1,
    )  # fmt: skip


def _layer_diff(counts: dict, key) -> dict[str, dict[str, float]]:
    """{"first": ..., "cached": ...}: what the second layer adds to the first microbatch of a step
    (its weight casts run) and to each later one (weight casts cached), from the counts of the
    (layers, microbatches) = (1, 1), (2, 1), (1, 2), (2, 2) graphs."""
    c = {lm: collections.Counter(key(v)) for lm, v in counts.items()}
    first = c[2, 1] - c[1, 1]
    cached = (c[2, 2] - c[1, 2]) - first
    # Counter subtraction drops what is <= 0; a negative count would be a bug of this census.
    assert not (c[1, 1] - c[2, 1]) and not (first - (c[2, 2] - c[1, 2])), "layers removed work"
    return {"first": dict(sorted(first.items())), "cached": dict(sorted(cached.items()))}


def layer_ops(cfg: ModelConfig, fp8: bool, device) -> dict:
    """What one TransformerLayer adds to the step graph, on the first microbatch of a step and
    on each later (cached) one.

    Returns:
        {"kernels": {"first": {op: CUDA kernels}, "cached": ...}, "memops": likewise for
        copy_ / fill_ / zero_ ops}, and on a GPU "nodes" ({node type: count}) and
        "kernel_names" ({kernel: count}), also split into first / cached.
    """
    graphs = {(n, m): step_graph(cfg, n, m, fp8, device) for n in (1, 2) for m in (1, 2)}
    ops = {lm: g.captured_ops() for lm, g in graphs.items()}
    row = {
        "kernels": _layer_diff(ops, lambda o: {k: v for k, v in kernels(o).items()
                                               if k not in MEMOPS}),
        "memops": _layer_diff(ops, lambda o: [n for n in o if n in MEMOPS]),
    }  # fmt: skip
    if torch.device(device).type == "cuda":
        nodes = {lm: g.captured_nodes() for lm, g in graphs.items()}
        row["nodes"] = _layer_diff(nodes, lambda n: [t for t, _ in n])
        row["kernel_names"] = _layer_diff(nodes, lambda n: [k for t, k in n if t == "KERNEL"])
    del graphs
    return row


def totals(row: dict, what: str = "kernels") -> tuple[int, int]:
    """(first, cached) totals of a layer_ops() entry."""
    return tuple(int(sum(row[what][mb].values())) for mb in ("first", "cached"))


def eager_memops(cfg: ModelConfig, device) -> dict[str, int]:
    """{launching op chain: count} of the memsets / memcpys of one eager FP8 microbatch of a
    two-layer GPT (the second of two: weight casts cached), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**cfg.__dict__, "layers": 2}), device=device)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), device=device)

    def microbatch(first: bool):
        with g8.fp8_autocast(enabled=True, recipe=g8.DelayedScaling()):
            h = model.blocks(model.embed(tokens), is_first_microbatch=first)
        model.loss(h, tokens).backward()

    microbatch(True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        microbatch(False)
        torch.cuda.synchronize()
    out: collections.Counter = collections.Counter()
    for evt in prof.events():
        for k in getattr(evt, "kernels", []):
            if not k.name.startswith(("Memset", "Memcpy")):
                continue
            chain, owner = [], evt
            while owner is not None and len(chain) < 4:
                if not owner.name.startswith(("cuda", "cu")):
                    chain.append(owner.name)
                owner = owner.cpu_parent
            out[f"{k.name} <- {' < '.join(chain)}"] += 1
    return dict(out.most_common())


def _rows(rows: dict, what: str) -> tuple[list[str], list[list]]:
    """Table rows of one count (kernels, memops, nodes, kernel_names): first / cached per recipe."""
    names = sorted({k for r in rows.values() for mb in r[what].values() for k in mb})
    header = [f"{name}: {mb}" for name in rows for mb in ("first", "cached")]
    body = [[k[:120], *[r[what][mb].get(k, 0) for r in rows.values()
                        for mb in ("first", "cached")]] for k in names]  # fmt: skip
    body.append(["total", *[sum(r[what][mb].values()) for r in rows.values()
                            for mb in ("first", "cached")]])  # fmt: skip
    return header, body


def run(device, quick: bool = False) -> dict:
    cfg = model_config(device, quick)
    rows = {"fp8 delayed": layer_ops(cfg, True, device)}
    if torch.device(device).type == "cpu":  # four more captures: the GPU run keeps to FP8
        rows["bf16"] = layer_ops(cfg, False, device)
    result = {"env": environment(device), "hidden": cfg.hidden, "layers": rows}
    titles = {
        "kernels": "CUDA kernels from the captured ops",
        "memops": "memcpy / memset ops among the captured ops (copy_, fill_, zero_, ...)",
        "nodes": "CUDA graph nodes by type",
        "kernel_names": "CUDA graph kernel nodes by kernel",
    }
    text = ""
    for what, title in titles.items():
        if what not in rows["fp8 delayed"]:
            continue
        header, body = _rows(rows, what)
        text += print_table(
            f"per TransformerLayer per microbatch of the step graph (h={cfg.hidden}; first "
            f"microbatch of a step / each later one): {title}", ["op", *header], body,
        )  # fmt: skip
    if torch.device(device).type == "cuda":
        result["eager_memops"] = eager_memops(cfg, device)
        text += print_table(
            "memset / memcpy of one eager FP8 microbatch (2 layers), by launching op",
            ["event <- ops", "count"], [[k, v] for k, v in result["eager_memops"].items()],
        )  # fmt: skip
    result["table"] = text
    return result
