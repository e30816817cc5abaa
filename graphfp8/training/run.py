"""One training run: a GPT in bf16 or FP8, eager or graphed, with gradient accumulation.
RunSpec, what a run trains and how, is training/spec.py's.

Per optimizer step, for each of `microbatches` microbatches: embedding (eager) -> the blocks
(one graph replay forward, one backward with graphs "layers"; an fp8_autocast region per
microbatch when eager) -> norm, head, cross entropy (eager) -> backward. Then (data parallel) one
all-reduce of the accumulated gradients, clipping, AdamW, zero_grad. `is_first_microbatch` is
True on the first microbatch of every step: the FP8 weights are cast then and reused by the
others. With graphs "step" all of that, embedding and head included, is one graph replay
(graphs.make_graphed_step) and gives the same bits: every mode runs the same fused AdamW with a
tensor learning rate.

No host sync inside a step: losses stay on the device until a log point asks for them.
"""

from __future__ import annotations

import math

import torch

from graphfp8.distributed.gradient_update import gradient_update
from graphfp8.distributed.masters import MasterWeights
from graphfp8.fp8.autocast import fp8_autocast
from graphfp8.fp8.primary import fp8_model_init
from graphfp8.fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
from graphfp8.graphs import make_graphed_callables, make_graphed_step
from graphfp8.graphs.fsdp import set_fsdp_sync
from graphfp8.nvtx_ranges import nvtx_range
from graphfp8.training.data import Dataset, split_windows
from graphfp8.training.fsdp import graph_layers, shard_gpt
from graphfp8.training.model import GPT
from graphfp8.training.spec import (
    GRAPH_MODES,
    OLDER_DEFAULTS,
    PRECISIONS,
    RECOMPUTE_MODES,
    SCALINGS,
    RunSpec,
    run_settings,
)
from graphfp8.training.staging import BatchStager
from graphfp8.training.torch_model import TorchGPT

# The spec's names stay importable from here (training/spec.py has them).
__all__ = ["GRAPH_MODES", "OLDER_DEFAULTS", "PRECISIONS", "RECOMPUTE_MODES", "SCALINGS", "Run",
           "RunSpec", "run_settings"]  # fmt: skip


class Run:
    """Model, optimizer and step counter of one run; `train_step` does one optimizer step.

    Args:
        spec: the run.
        data: the training (and validation) tokens; each rank reads its own shard of a batch.
        group: torch.distributed group for data parallelism (gradients all-reduced, FP8 amaxes
            MAX-reduced), or None.
    """

    def __init__(self, spec: RunSpec, data: Dataset, group=None):
        if spec.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {spec.precision!r}")
        if data.vocab_size > spec.model.vocab:
            raise ValueError(f"the data's vocabulary ({data.vocab_size}) is larger than the "
                             f"model's ({spec.model.vocab})")  # fmt: skip
        if data.pack != spec.pack:
            raise ValueError(f"the run packs documents ({spec.pack}), the data not ({data.pack})")
        self.spec, self.data, self.group = spec, data, group
        self.rank = torch.distributed.get_rank(group) if group is not None else 0
        self.world = torch.distributed.get_world_size(group) if group is not None else 1
        if spec.scaling == "current":
            self.recipe = Float8CurrentScaling(fp8_format=Format[spec.fp8_format])
        elif spec.scaling == "blockwise":  # E4M3 everywhere (checked: cli_checks.py)
            self.recipe = Float8BlockScaling()
        else:
            self.recipe = DelayedScaling(amax_history_len=spec.amax_history_len,
                                         fp8_format=Format[spec.fp8_format],
                                         fp8_dpa=spec.fp8_attention,
                                         fp8_mha=spec.fp8_attention)  # fmt: skip
        torch.manual_seed(spec.seed)  # identical initial weights in every run and on every rank
        if spec.graphs == "compile":
            self.model = TorchGPT(spec.model, torch.bfloat16, spec.device)
        else:
            # Blockwise FP8 weights are stored in 128x128 blocks (fp8/primary.py).
            with fp8_model_init(enabled=spec.fp8_weights, recipe=self.recipe):
                self.model = GPT(spec.model, torch.bfloat16, spec.device, spec.bf16_layers)
            for layer in self.model.blocks.layers:
                layer.recompute = spec.recompute
        if spec.fsdp:
            shard_gpt(self.model, group, spec.device, spec.hsdp, root=spec.graphs == "step",
                      prefetch=spec.fsdp_prefetch)  # fmt: skip
        self.masters, self.reduce_group = self._masters()
        # reduce -> clip -> step -> write back, whatever is sharded (gradient_update.py); every rank
        # trains every parameter: the gradient sets are checked once.
        self.update = gradient_update(self.model.parameters, self.reduce_group, self.masters,
                                      name="graphfp8-train", check_every_step=False)  # fmt: skip
        params = self.masters.parameters() if self.masters else self.model.parameters()
        # Fused, with the learning rate as a device tensor, in every mode: a step graph can
        # capture it (capturable on the GPU), and all modes compute the same bits.
        capturable = spec.graphs == "step" and torch.device(spec.device).type == "cuda"
        self.optimizer = torch.optim.AdamW(
            params, lr=torch.tensor(spec.model.lr, device=spec.device),
            betas=(0.9, 0.95), weight_decay=0.1, fused=True, capturable=capturable,
        )  # fmt: skip
        self.step = 0
        self.fp8_stats = None  # graphfp8.numerics.FP8Stats while the run records FP8 statistics
        self.blocks = None  # runs the blocks (graphs "compile": the whole model), set by prepare()
        self.graphed_step = None  # graphs "step": the captured step, set by prepare()
        self.batches = BatchStager(self._host_microbatch, spec.microbatches, spec.device,
                                   ahead=spec.stage_batches)  # fmt: skip

    @property
    def fp8(self) -> bool:
        return self.spec.precision == "fp8"

    def _masters(self) -> tuple:
        """(fp32 masters or None, the group whose gradients the step all-reduces or None): with
        spec.shard, masters of every parameter sharded over the group, which reduce the
        gradients themselves; with spec.fp8_weights, masters of the FP8 weights; else none
        (AdamW steps the bf16 parameters)."""
        if not self.spec.shard:  # FSDP2 (spec.fsdp) reduce-scatters the gradients itself
            masters = MasterWeights(self.model) if self.spec.fp8_weights else None
            return masters, None if self.spec.fsdp else self.group
        if self.group is None:
            raise ValueError("shard needs a process group (--ddp under torchrun)")
        # Every rank trains every parameter: the gradient sets are checked once.
        return MasterWeights(self.model, shard_group=self.group, check_every_step=False), None

    def prepare(self) -> None:
        """Compiles what the graphs do not hold when the run says so, and captures the blocks,
        or the whole step, when the run uses graphs (after any checkpoint was loaded)."""
        if self.spec.compile:
            self._compile()
        if self.spec.graphs == "step":
            self._prepare_step()
            return
        if self.spec.graphs == "none":
            self.blocks = self._eager_blocks
            return
        if self.spec.graphs == "compile":  # the whole model: (tokens, targets) -> loss
            self.blocks = torch.compile(self.model)
            return
        cfg = self.spec.model
        sample = torch.randn(cfg.batch, cfg.seq_len, cfg.hidden, dtype=torch.bfloat16,
                             device=self.spec.device, requires_grad=True)  # fmt: skip
        if self.spec.fsdp:  # a graph pair per FSDP2 layer, the blocks' root eager around them
            graph_layers(self.model, sample, self._segments_kw(), self.fp8, self.recipe,
                         self.group, self.spec.fsdp_sync)  # fmt: skip
            self.blocks = self._eager_blocks
            return
        self.blocks = make_graphed_callables(
            self.model.blocks, (sample,), fp8_enabled=self.fp8, fp8_recipe=self.recipe,
            fp8_weight_caching=True, fp8_group=self.group, sample_kwargs=self._segments_kw(),
        )  # fmt: skip

    def _segments_kw(self, segments=None) -> dict:
        """{"segment_ids": segments} for packed runs (zeros of a microbatch's shape when None),
        {} otherwise."""
        if not self.spec.pack:
            return {}
        if segments is None:
            cfg = self.spec.model
            segments = torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.int64,
                                   device=self.spec.device)  # fmt: skip
        return {"segment_ids": segments}

    def _prepare_step(self) -> None:
        for group in self.optimizer.param_groups:  # a checkpoint of another mode may say False
            group["capturable"] = torch.device(self.spec.device).type == "cuda"
        cfg, mbs = self.spec.model, self.spec.microbatches
        # A sample of the batch's shape (token 0 everywhere): taking one from the data would
        # consume it.
        tokens = torch.zeros(
            mbs, cfg.batch, cfg.seq_len, dtype=torch.int64, device=self.spec.device
        )
        inputs = (
            (tokens, tokens.clone(), tokens.clone()) if self.spec.pack else (tokens, tokens.clone())
        )
        self.graphed_step = make_graphed_step(
            self.model, None, self.optimizer, (inputs, ()), mbs,
            fp8_enabled=self.fp8, fp8_recipe=self.recipe, fp8_weight_caching=True,
            max_grad_norm=1.0, fp8_group=self.group,
            process_group=self.reduce_group, master_weights=self.masters,
            fsdp_sync=self.spec.fsdp_sync,
            num_warmup_iters=3 if torch.device(self.spec.device).type == "cuda" else 1,
        )  # fmt: skip

    def _step_batch(self, batches):
        """This step's microbatches (BatchStager.take's) stacked straight into the step graph's
        static batch ((inputs, targets[, segments]), (): the model's output is the loss)."""
        static = self.graphed_step.static_batch
        parts = [split_windows(*batch) for batch in batches]  # (inputs, targets, segments)
        for i, out in enumerate(static):
            torch.stack([p[i] for p in parts], out=out)
        return tuple(static), ()

    def _compile(self) -> None:
        """torch.compile (in place: checkpoints keep their keys) the embedding and the loss (norm,
        head, cross entropy), and the blocks when they are not graphed: dynamo then graph-breaks
        around each FP8 layer (docs/architecture.md, "torch.compile")."""
        self.model.embed.compile()
        self.model.loss = torch.compile(self.model.loss)
        if self.spec.graphs == "none":
            self.model.blocks.compile()

    def _eager_blocks(self, x, is_first_microbatch=None, **segments):
        with fp8_autocast(enabled=self.fp8, recipe=self.recipe, fp8_group=self.group):
            return self.model.blocks(x, is_first_microbatch=is_first_microbatch, **segments)

    def lr_at(self, step: int, total: int) -> float:
        """Linear warm-up over the first 10% of steps (at most 100), then cosine to 10%."""
        warmup = max(1, min(100, total // 10))
        if step < warmup:
            return self.spec.model.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return self.spec.model.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, t))))

    def _host_microbatch(self, step: int, mb: int) -> tuple[torch.Tensor, ...]:
        """Microbatch mb of step `step` on the CPU: (tokens[, segments]), each (b, S + 1) int64."""
        cfg = self.spec.model
        args = (step, mb, cfg.batch, cfg.seq_len, self.spec.seed, self.rank, self.world)
        tokens = self.data.train_batch(*args)
        return (tokens, self.data.train_segments(*args)) if self.spec.pack else (tokens,)

    def train_step(self, total_steps: int) -> torch.Tensor:
        """One optimizer step over `microbatches` microbatches. Returns the step's mean loss as
        a 0-d float32 device tensor (not synchronised)."""
        lr = self.lr_at(self.step, total_steps)
        for group in self.optimizer.param_groups:  # in place: a step graph reads the tensor
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:  # a checkpoint written before the learning rate became a tensor
                group["lr"] = lr
        batches = self.batches.take(self.step)
        if self.graphed_step is not None:
            with nvtx_range("step"):
                loss = self.graphed_step(self._step_batch(batches)).clone()
            if self.fp8_stats is not None:  # one graph: each slot's latest cast of the step
                self.fp8_stats.collect(self.step, self.spec.microbatches - 1)
            self.step += 1
            self.batches.stage(self.step, total_steps)  # the next step's, while this one runs
            return loss
        mbs = self.spec.microbatches
        total = torch.zeros((), dtype=torch.float32, device=self.spec.device)
        for mb, batch in enumerate(batches):
            if self.spec.fsdp_sync == "last":  # as make_graphed_step(fsdp_sync="last")
                set_fsdp_sync(self.model, mb == mbs - 1)
            inputs, targets, segments = split_windows(*batch)
            with nvtx_range("forward"):
                loss = self._loss(inputs, targets, segments, mb) / mbs
            with nvtx_range("backward"):
                loss.backward()
            if self.fp8_stats is not None:
                self.fp8_stats.collect(self.step, mb)
            total += loss.detach()
        with nvtx_range("optimizer"):
            self._optimizer_step()
        self.step += 1
        self.batches.stage(self.step, total_steps)
        return total

    def _loss(self, inputs, targets, segments, mb: int) -> torch.Tensor:
        """A microbatch's mean loss (float32): the compiled torch model's, or graphfp8's GPT's."""
        if self.spec.graphs == "compile":
            return self.blocks(inputs, targets)
        hidden = self.blocks(self.model.embed(inputs), is_first_microbatch=mb == 0,
                             **self._segments_kw(segments))  # fmt: skip
        return self.model.loss(hidden, targets)

    def _optimizer_step(self) -> None:
        """After the microbatches of an eager or layers step: the gradient reduction, clipping to
        1.0 and AdamW (through the masters when there are any), then zero_grad."""
        self.update.reduce_grads_()
        self.update.clip_grad_norm_(1.0)
        self.update.step(self.optimizer)
        self.update.zero_grad(set_to_none=True)

    # Checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "spec": run_settings(self.spec),
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **({"masters": self.masters.state_dict()} if self.masters else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resumes from `state_dict()`; the run must train the same model the same way."""
        saved, mine = {**OLDER_DEFAULTS, **state["spec"]}, run_settings(self.spec)
        diff = [f"{k}: checkpoint {saved[k]!r}, this run {mine[k]!r}"
                for k in mine if saved.get(k) != mine[k]]  # fmt: skip
        if diff:
            raise ValueError("checkpoint does not match this run: " + "; ".join(diff))
        prepared = self.blocks is not None or self.graphed_step is not None
        if prepared and self.spec.graphs != "none":
            raise RuntimeError("load the checkpoint before prepare(): the graphs are captured")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.masters is not None:
            self.masters.load_state_dict(state["masters"])
        self.step = state["step"]
