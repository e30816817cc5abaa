"""The memory planner: the bytes per rank of training a preset with graphfp8-train, by category,
and the largest model of a preset's width that fits one GPU (docs/sharding.md, "Memory planner").

    python -m graphfp8.memory.plan --preset llama-8b --n 8 --seq 8192 --batch 1 \\
        --sharding fsdp2 --recompute full --fp8-weights

Persistent state per rank (P parameters, P8 of them in the layers' FP8 GEMMs, Po = P - P8; N
ranks; bytes per element):

    sharding  fp8 weights  weights                 FP8 caches  grads    masters   optimizer
    ddp       no           2 P                     2 P8        2 P      -         4 P (bf16 AdamW)
    ddp       yes          2 P8 + 2 Po             -           2 P      4 P8      8 P8 + 4 Po
    zero2     either       as ddp                  as ddp      2 P      8 P / N   8 P / N
    fsdp2     no           2 P / N + 2 Pr          2 P8        2 P / N  -         4 P / N
    fsdp2     yes          (P8 + 2 Po) / N + 2 Pr  -           2 P / N  4 P8 / N  (8 P8 + 4 Po) / N

(zero2: graphfp8's sharded masters, MasterWeights(shard_group=...): fp32 masters and their
gradients; FP8 weights carry their transpose, 1 + 1 bytes. fsdp2: graphfp8-train's FSDP2
(training/fsdp.py), eager, reshard_after_forward True; Pr: the embedding, final norm and head,
each an FSDP2 root that stays all-gathered from its forward to its backward; the reduce-scatters'
bf16 gradient shards; FSDP2 keeps bf16 weights' FP8 casts of every layer, so it pays with FP8
weights. A layer's backward adds its all-gathered weights and the next one's (prefetched), 2 L
each, and its unsharded gradients and their reduce-scatter copy, 2 L each (L: a layer's
elements), the head and final norm resharded by then. Its optimizer step: the masters' fp32
gradient shards replace the bf16 ones (2 P8 / N); nothing at the parameters' global shapes
(graphfp8/distributed/optimizer_meta.py: fused AdamW's tensor learning rate once cost 16 P8 + 8
Po at the first step).) Activations and the working set
on top of them: graphfp8/memory/plan_activations.py. The optimizer step's transient: unsharded
masters' fp32 gradients, which replace the FP8 weights' bf16 ones eagerly (2 P8 more) and sit
beside them with per-layer graphs (4 P8).

Graph pools and what is counted where (docs/sharding.md, "Memory planner"): `peak` is
torch.cuda.max_memory_allocated's peak, which counts a graph's private pool only while it is
captured (a replay allocates nothing), `footprint` the peak with the pools held, what must fit.
In every mode the peak is at least graphfp8-train's eager validation pass beside the state and
the static buffers (plan_activations.validation_bytes): the peak with per-layer graphs when the
vocabulary is small beside the width.

    none    state + max(activations + working set, optimizer transient, validation)
    layers  graph pools: the blocks' graph pair's static input, output and input gradient, 6 T H.
            peak: the replays' eager part (the head's activations and the loss's working set,
            or the optimizer's transient) beside the state and the static buffers, or the
            capture (before the first step: no optimizer state, the blocks' persistent .grad
            buffers only) if larger; footprint: the blocks' activations and working set held in
            the pool beside that
    step    graph pools: none beyond the microbatch's memory (the copy of the weights and
            masters that undoes the warmup lives in host memory and is dropped after the
            capture: graphs/step_optim.py's TrainingSnapshot); the unsharded masters' fp32
            gradients are the graph's buffers (masters: 8 P8).
            peak: the capture, everything at once; footprint: an eager validation pass's loss
            (8 T V) outside the pool on top
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

from graphfp8.memory.plan_activations import (
    RECOMPUTE,
    activation_bytes,
    head_bytes,
    layer_working_set_bytes,
    loss_working_set_bytes,
    validation_bytes,
    working_set_bytes,
)
from graphfp8.memory.shapes import LLAMA, ModelShape, shape_of

__all__ = ["CATEGORIES", "H200_BYTES", "MARGIN_BYTES", "Plan", "largest_fit", "plan"]

GIB = 1 << 30
H200_BYTES = 139 * GIB  # what torch can allocate on one H200 (141 GB less the CUDA context)
MARGIN_BYTES = 8 * GIB  # kept free: NCCL buffers, allocator rounding and fragmentation
SHARDINGS = ("ddp", "zero2", "fsdp2")
GRAPH_MODES = ("none", "layers", "step")
CATEGORIES = ("weights", "FP8 caches", "gradients", "masters", "optimizer state", "activations",
              "working set", "graph pools")  # fmt: skip


@dataclass
class Plan:
    """Bytes per rank by category (CATEGORIES), the peak, and what was planned.

    Attributes:
        optimizer_transient: the optimizer step's transient (module docstring).
        eager_microbatch: graphs "layers": what a microbatch's eager part (embedding, head,
            loss) holds at most beside the replays: the head's activations and the loss's
            working set.
        capture_peak: graphs "layers": the peak while the blocks are captured.
        watch_copy: zero2: the sharded masters' copy of this rank's range of the weights, which
            tells a model changed since the write-back (distributed/sharded_guard.py ModelWatch;
            not training state).
        validation: graphfp8-train's eager validation pass beside the state and the graphs'
            static buffers (plan_activations.validation_bytes).
    """

    setting: dict
    parameters: int
    bytes: dict[str, int] = field(default_factory=dict)
    optimizer_transient: int = 0
    eager_microbatch: int = 0
    capture_peak: int = 0
    watch_copy: int = 0
    validation: int = 0

    @property
    def state(self) -> int:
        return sum(self.bytes[c] for c in CATEGORIES[:5])

    @property
    def _held(self) -> int:
        """The state and what the run holds beside it for good."""
        return self.state + self.watch_copy

    @property
    def microbatch(self) -> int:
        return self.bytes["activations"] + self.bytes["working set"]

    @property
    def peak(self) -> int:
        """torch.cuda.max_memory_allocated's peak (graph pools counted while captured: module
        docstring)."""
        graphs, pools = self.setting["graphs"], self.bytes["graph pools"]
        validation = self._held + pools + self.validation
        if graphs == "step":
            return max(self._held + pools + self.microbatch, validation)
        if graphs == "layers":
            replays = self._held + pools + max(self.eager_microbatch, self.optimizer_transient)
            return max(self.capture_peak, replays, validation)
        return self._held + max(self.microbatch, self.optimizer_transient, self.validation)

    @property
    def footprint(self) -> int:
        """The peak with the graphs' private pools held (what must fit a GPU): per-layer graphs'
        pool keeps the microbatch's memory while the optimizer runs eagerly; after a step graph's
        capture an eager validation pass allocates outside its pool."""
        graphs = self.setting["graphs"]
        if graphs == "layers":  # (or the peak: a validation pass's or the capture's)
            held = self._held + self.bytes["graph pools"] + self.microbatch
            return max(self.peak, held + self.optimizer_transient)
        if graphs == "step":
            return self.peak + loss_working_set_bytes(self._shape(), self._tokens())
        return self.peak

    def _shape(self) -> ModelShape:
        return ModelShape(**self.setting["shape"])

    def _tokens(self) -> int:
        return self.setting["seq"] * self.setting["batch"]

    def fits(self, capacity: int = H200_BYTES, margin: int = MARGIN_BYTES) -> bool:
        return self.footprint <= capacity - margin

    def to_dict(self) -> dict:
        return {"setting": self.setting, "parameters": self.parameters, "bytes": self.bytes,
                "optimizer_transient": self.optimizer_transient, "peak": self.peak,
                "footprint": self.footprint, "watch_copy": self.watch_copy,
                "bytes_per_parameter": self.state / self.parameters}  # fmt: skip

    def format(self) -> str:
        s = self.setting
        lines = [
            f"{s['preset']}: {self.parameters / 1e9:.2f}B parameters, N={s['n']} {s['sharding']}, "
            f"batch {s['batch']} x seq {s['seq']}, recompute {s['recompute']}, FP8 weights "
            f"{s['fp8_weights']}, graphs {s['graphs']}"
        ]
        for c in CATEGORIES:
            lines.append(f"  {c:<16} {self.bytes[c] / GIB:9.2f} GiB")
        lines.append(f"  {'state':<16} {self.state / GIB:9.2f} GiB "
                     f"({self.state / self.parameters:.2f} B/param)")  # fmt: skip
        lines.append(f"  {'peak allocated':<16} {self.peak / GIB:9.2f} GiB")
        lines.append(f"  {'footprint':<16} {self.footprint / GIB:9.2f} GiB of "
                     f"{H200_BYTES / GIB:.0f} GiB "
                     f"(margin {MARGIN_BYTES / GIB:.0f} GiB): "
                     f"{'fits' if self.fits() else 'does NOT fit'}")  # fmt: skip
        return "\n".join(lines)


def _state(shape: ModelShape, n: int, sharding: str, fp8_weights: bool) -> dict[str, float]:
    p8 = shape.layers * shape.fp8_layer_params()
    p = shape.parameters()
    po = p - p8
    if sharding == "fsdp2":  # the roots (embedding, final norm, head) stay gathered: 2 Pr
        roots = 2 * shape.other_params()
        if fp8_weights:
            return {"weights": (p8 + 2 * po) / n + roots, "FP8 caches": 0,
                    "gradients": 2 * p / n, "masters": 4 * p8 / n,
                    "optimizer state": (8 * p8 + 4 * po) / n}  # fmt: skip
        return {"weights": 2 * p / n + roots, "FP8 caches": 2 * p8, "gradients": 2 * p / n,
                "masters": 0, "optimizer state": 4 * p / n}  # fmt: skip
    weights = 2 * p8 + 2 * po
    caches = 0 if fp8_weights else 2 * p8
    if sharding == "zero2":
        return {"weights": weights, "FP8 caches": caches, "gradients": 2 * p,
                "masters": 8 * p / n, "optimizer state": 8 * p / n}  # fmt: skip
    if fp8_weights:
        return {"weights": weights, "FP8 caches": 0, "gradients": 2 * p, "masters": 4 * p8,
                "optimizer state": 8 * p8 + 4 * po}  # fmt: skip
    return {"weights": weights, "FP8 caches": caches, "gradients": 2 * p, "masters": 0,
            "optimizer state": 4 * p}  # fmt: skip


def plan(preset: str | ModelShape, n: int = 1, seq: int = 2048, batch: int = 1,
         sharding: str = "ddp", recompute: str = "none", fp8_weights: bool = False,
         graphs: str = "layers") -> Plan:  # fmt: skip
    """The bytes per rank of graphfp8-train for this setting.

    Args:
        preset: a Llama preset's name (graphfp8.memory.shapes.LLAMA) or a ModelShape (a
            graphfp8-train preset's: shapes.shape_from).
        n: ranks; seq, batch: tokens per sequence and sequences per microbatch per rank.
        sharding: "ddp", "zero2" (sharded masters) or "fsdp2".
        recompute: "none", "selective" or "full".
        fp8_weights: FP8 primary weights (fp8_model_init) with fp32 masters.
        graphs: "none", "layers" (per-layer graphs) or "step".
    """
    shape = shape_of(preset) if isinstance(preset, str) else preset
    for name, value, allowed in (("sharding", sharding, SHARDINGS),
                                 ("recompute", recompute, RECOMPUTE),
                                 ("graphs", graphs, GRAPH_MODES)):  # fmt: skip
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if n < 1 or seq < 1 or batch < 1:
        raise ValueError(f"n, seq and batch must be positive, got {n}, {seq}, {batch}")
    tokens = seq * batch
    setting = dict(preset=preset if isinstance(preset, str) else "custom", n=n, seq=seq,
                   batch=batch, sharding=sharding, recompute=recompute, fp8_weights=fp8_weights,
                   graphs=graphs, shape=dataclasses.asdict(shape))  # fmt: skip
    out = Plan(setting, shape.parameters())
    out.bytes = {k: round(v) for k, v in _state(shape, n, sharding, fp8_weights).items()}
    out.bytes["activations"] = activation_bytes(shape, tokens, recompute)
    out.bytes["working set"] = working_set_bytes(shape, tokens, recompute)
    if sharding == "fsdp2":  # a layer's backward under FSDP2 (module docstring)
        resharded = 2 * (shape.other_params() - shape.vocab * shape.hidden)
        layer = layer_working_set_bytes(shape, tokens, recompute) + 8 * shape.layer_params()
        out.bytes["working set"] = max(loss_working_set_bytes(shape, tokens), layer - resharded)
    fp8_masters = 4 * shape.layers * shape.fp8_layer_params() if fp8_weights else 0
    # the masters' values (zero2's masters bytes hold their gradients too)
    master_values = {"ddp": fp8_masters, "zero2": out.bytes["masters"] // 2}.get(
        sharding, out.bytes["masters"])  # fmt: skip
    out.bytes["graph pools"] = 0
    out.validation = validation_bytes(shape, tokens)
    if graphs == "layers":  # the blocks' graph pair: static input, output and input gradient
        out.bytes["graph pools"] = 6 * tokens * shape.hidden
        head = head_bytes(shape, tokens)
        out.eager_microbatch = head + loss_working_set_bytes(shape, tokens)
        blocks = out.bytes["activations"] - head
        layer = max(0, layer_working_set_bytes(shape, tokens, recompute))
        grad_buffers = 2 * shape.layers * shape.layer_params()  # the blocks' persistent .grad
        out.capture_peak = (out.bytes["weights"] + out.bytes["FP8 caches"] + master_values
                            + out.bytes["graph pools"] + grad_buffers + blocks + layer)  # fmt: skip
    elif graphs == "step":  # the graph's fp32 master gradients (module docstring)
        out.bytes["masters"] += fp8_masters if sharding == "ddp" else 0
    # unsharded MasterWeights outside a step graph: the fp32 gradients of the optimizer step,
    # which replace the FP8 weights' bf16 ones eagerly and sit beside them with per-layer graphs
    # (their persistent .grad; docs/sharding.md: 19.93 B/param on the H200); sharded masters and
    # FSDP2 count theirs above
    if sharding == "fsdp2" and fp8_weights:  # the masters' fp32 gradient shards (docstring)
        out.optimizer_transient = round(2 * shape.layers * shape.fp8_layer_params() / n)
    if sharding == "ddp" and graphs != "step":
        out.optimizer_transient = fp8_masters // (2 if graphs == "none" else 1)
    if sharding == "zero2":  # the flat weights' bytes: FP8 data without its transpose
        p8 = shape.layers * shape.fp8_layer_params()
        out.watch_copy = round(((1 if fp8_weights else 2) * p8 + 2 * (shape.parameters() - p8)) / n)
    return out


def largest_fit(preset: str | ModelShape, n: int, capacity: int = H200_BYTES,
                margin: int = MARGIN_BYTES, **kw) -> Plan | None:  # fmt: skip
    """The deepest model of `preset`'s layer shape (its width, heads and vocabulary; any number of
    layers) whose plan's footprint fits `capacity` less `margin` per rank, or None if one layer
    does not."""
    shape = shape_of(preset) if isinstance(preset, str) else preset
    best, name = None, preset if isinstance(preset, str) else "custom"
    lo, hi = 1, 4096
    while lo <= hi:
        mid = (lo + hi) // 2
        p = plan(dataclasses.replace(shape, layers=mid), n=n, **kw)
        if p.footprint <= capacity - margin:
            best, lo = p, mid + 1
        else:
            hi = mid - 1
    if best is not None:
        best.setting["preset"] = f"{name} ({best.setting['shape']['layers']} layers)"
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphfp8.memory.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--preset", choices=sorted(LLAMA), default="llama-8b")
    p.add_argument("--layers", type=int, help="the preset's layer shape with this many layers")
    p.add_argument("--n", type=int, default=1, help="ranks (GPUs)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1, help="sequences per microbatch per rank")
    p.add_argument("--sharding", choices=SHARDINGS, default="ddp")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none")
    p.add_argument("--fp8-weights", action="store_true")
    p.add_argument("--graphs", choices=GRAPH_MODES, default="layers")
    p.add_argument("--fit", action="store_true", help="also the deepest model of the preset's "
                   "width that fits an H200")  # fmt: skip
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    kw = dict(seq=args.seq, batch=args.batch, sharding=args.sharding, recompute=args.recompute,
              fp8_weights=args.fp8_weights, graphs=args.graphs)  # fmt: skip
    shape = shape_of(args.preset)
    if args.layers is not None:
        shape = dataclasses.replace(shape, layers=args.layers)
    result = plan(shape, n=args.n, **kw)
    result.setting["preset"] = args.preset + (f" ({args.layers} layers)" if args.layers else "")
    fit = largest_fit(args.preset, args.n, **kw) if args.fit else None
    if args.json:
        print(json.dumps({"plan": result.to_dict(), "largest_fit": fit and fit.to_dict()}))
        return 0
    print(result.format())
    if args.fit:
        print("largest that fits:\n" + (fit.format() if fit else "  not even one layer"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
