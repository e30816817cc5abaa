"""The main job until graphfp8-train lands: train a small graphfp8 model three ways - bf16
eager, FP8 eager and FP8 graphed - on the same synthetic data, check that the graphed run equals
the eager one bit for bit, and print losses and time per step.

    python -m graphfp8.demo [--device cpu|cuda] [--steps N] [--microbatches M]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import graphfp8 as g8


class Model(nn.Module):
    """Residual stack of graphfp8 LayerNormMLP blocks and a final LayerNormLinear head."""

    def __init__(self, hidden: int, layers: int, device):
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16, device=device)
        self.blocks = nn.ModuleList(g8.LayerNormMLP(hidden, 4 * hidden, **kw)
                                    for _ in range(layers))  # fmt: skip
        self.head = g8.LayerNormLinear(hidden, hidden, **kw)

    def forward(self, x, is_first_microbatch=None):
        for block in self.blocks:
            x = x + block(x, is_first_microbatch=is_first_microbatch)
        return self.head(x, is_first_microbatch=is_first_microbatch)


def _data(args, device):
    """A fixed random teacher: targets = teacher(x), inputs of varying scale."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(args.hidden, args.hidden, generator=g) / args.hidden**0.5
    batches = []
    for _ in range(args.steps * args.microbatches):
        x = torch.randn(args.tokens, args.hidden, generator=g)
        batches.append((x.to(device, torch.bfloat16), torch.tanh(x @ teacher).to(device)))
    return batches


def _train(model, step_fn, batches, args, device):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        total = 0.0
        for mb in range(args.microbatches):
            x, target = batches[step * args.microbatches + mb]
            y = step_fn(x, mb == 0)
            loss = (y.float() - target).square().mean() / args.microbatches
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return losses, (time.perf_counter() - t0) / args.steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m graphfp8.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=None, help="default: 64 CPU, 1024 GPU")
    parser.add_argument("--tokens", type=int, default=None, help="default: 64 CPU, 2048 GPU")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.hidden = args.hidden or (1024 if gpu else 64)
    args.tokens = args.tokens or (2048 if gpu else 64)
    for name in ("steps", "microbatches", "layers", "hidden", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.hidden % 16 or args.tokens % 16:
        parser.error("--hidden and --tokens must be multiples of 16 (FP8 GEMMs)")
    torch.manual_seed(0)
    batches = _data(args, device)
    bf16 = Model(args.hidden, args.layers, device)
    fp8_eager, fp8_graphed = copy.deepcopy(bf16), copy.deepcopy(bf16)
    recipe = g8.DelayedScaling(amax_history_len=16)
    sample = torch.zeros(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    graphed = g8.make_graphed_callables(fp8_graphed, (sample,), fp8_enabled=True,
                                        fp8_recipe=recipe, fp8_weight_caching=True)  # fmt: skip

    def eager_step(x, first):
        with g8.fp8_autocast(recipe=recipe):
            return fp8_eager(x, is_first_microbatch=first)

    runs = {
        "bf16 eager": _train(bf16, lambda x, first: bf16(x), batches, args, device),
        "fp8 eager": _train(fp8_eager, eager_step, batches, args, device),
        "fp8 graphed": _train(
            fp8_graphed,
            lambda x, first: graphed(x, is_first_microbatch=first),
            batches,
            args,
            device,
        ),  # fmt: skip
    }
    print(
        f"{args.layers} x LayerNormMLP({args.hidden}) + head, {args.tokens} tokens x "
        f"{args.microbatches} microbatches per step, {device}"
    )
    print(f"{'step':>5} " + " ".join(f"{name:>14}" for name in runs))
    for step in range(args.steps):
        print(f"{step:5d} " + " ".join(f"{losses[step]:14.6f}" for losses, _ in runs.values()))
    print("s/step " + " ".join(f"{sec:14.4f}" for _, sec in runs.values()))
    same = runs["fp8 graphed"][0] == runs["fp8 eager"][0] and all(
        torch.equal(a, b) for a, b in zip(fp8_eager.parameters(), fp8_graphed.parameters())
    )
    print("fp8 graphed == fp8 eager, bit for bit (losses and weights):", same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
