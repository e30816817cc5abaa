"""What one training run trains and how: RunSpec (checked on construction), the settings a
checkpoint records (run_settings) and the defaults of checkpoints older than a setting."""

from __future__ import annotations

from dataclasses import dataclass

from graphfp8.fp8.recipe import Format
from graphfp8.modules.transformer import RECOMPUTE_MODES
from graphfp8.training.fsdp import check_fsdp_spec
from graphfp8.training.presets import ModelConfig

__all__ = ["GRAPH_MODES", "OLDER_DEFAULTS", "PRECISIONS", "RECOMPUTE_MODES", "SCALINGS", "RunSpec",
           "run_settings"]  # fmt: skip

PRECISIONS = ("bf16", "fp8")
SCALINGS = ("delayed", "current", "blockwise")
# none: eager; layers: blocks graphed; step: the whole step; compile: the bf16 baseline, compiled
GRAPH_MODES = ("none", "layers", "step", "compile")
_MODE_NAMES = {"none": "eager", "layers": "graphs", "step": "step", "compile": "torch-compile"}


@dataclass(frozen=True)
class RunSpec:
    """What one run trains and how."""

    preset: str
    model: ModelConfig
    precision: str  # "bf16" or "fp8"
    graphs: str  # one of GRAPH_MODES (True/False mean "layers"/"none")
    microbatches: int
    device: str
    seed: int = 0
    amax_history_len: int = 16
    compile: bool = False  # torch.compile what the graphs do not hold
    fp8_format: str = "HYBRID"  # graphfp8.Format: HYBRID (E5M2 gradients) or E4M3
    scaling: str = "delayed"  # one of SCALINGS: the FP8 recipe
    fp8_weights: bool = False  # FP8 primary weights (fp8_model_init) with fp32 MasterWeights
    pack: bool = False  # packed documents: attention and targets within each document
    # FP8 attention: RoPE fused into the casts of q, k, v, cuDNN's FP8 attention, its FP8 output
    # straight into the projection (DelayedScaling(fp8_dpa=True, fp8_mha=True)); packed batches
    # keep bf16 attention (graphfp8.modules.attention says why)
    fp8_attention: bool = False
    shard: bool = False  # masters, gradients and optimizer state sharded over the group
    fsdp: bool = False  # the weights sharded too, by torch FSDP2 (training/fsdp.py): eager, step
    hsdp: int = 1  # with fsdp: replicas, each sharded over world / hsdp ranks (HSDP, fsdp.py)
    fsdp_sync: str = "every"  # with fsdp: FSDP2 reduce-scatters after "every" microbatch or "last"
    # with fsdp: each layer issues the next layer's all-gather (forward), the previous's (backward)
    fsdp_prefetch: bool = False
    # Blocks kept in bf16 in an FP8 run (Megatron's --first-last-layers-bf16): their indices
    bf16_layers: tuple[int, ...] = ()
    # activation recompute of every layer (TransformerLayer's RECOMPUTE_MODES): the same bits,
    # less activation memory, more compute; not a checkpoint setting (a resume may change it)
    recompute: str = "none"
    stage_batches: bool = False  # the next step's batches copied ahead (staging.py): the same bits

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.fp8_weights and self.precision != "fp8":
            raise ValueError("fp8_weights needs precision fp8")
        if any(not 0 <= i < self.model.layers for i in self.bf16_layers):
            raise ValueError(f"bf16_layers {self.bf16_layers}: the model has layers 0 to "
                             f"{self.model.layers - 1}")  # fmt: skip
        if self.bf16_layers and (self.precision != "fp8" or self.fp8_weights):
            raise ValueError("bf16_layers needs precision fp8 without fp8_weights (an FP8 "
                             "primary weight has no bf16 copy)")  # fmt: skip
        if self.fp8_weights and self.scaling == "blockwise" and self.fsdp:
            raise ValueError("fp8_weights with blockwise scaling under fsdp is not supported "
                             "(torch FSDP2 of 128x128-block FP8 weights); use shard")  # fmt: skip
        if self.fp8_attention and (self.precision != "fp8" or self.scaling != "delayed"):
            raise ValueError("fp8_attention needs precision fp8 with delayed scaling (FP8 "
                             "attention is DelayedScaling only)")  # fmt: skip
        if isinstance(self.graphs, bool):
            object.__setattr__(self, "graphs", "layers" if self.graphs else "none")
        if self.graphs not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {GRAPH_MODES}, got {self.graphs!r}")
        if self.fp8_format not in Format.__members__:
            raise ValueError(f"fp8_format must be one of {list(Format.__members__)}, got "
                             f"{self.fp8_format!r}")  # fmt: skip
        check_fsdp_spec(self)
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got "
                             f"{self.recompute!r}")  # fmt: skip
        if self.compile and self.graphs == "none" and self.recompute != "none":
            raise ValueError("compile without graphs compiles the blocks, and dynamo cannot trace "
                             "graphfp8's recompute (its FP8 context): use graphs with compile, "
                             "or recompute 'none'")  # fmt: skip
        plain = self.precision == "bf16" and not (self.pack or self.shard or self.fp8_weights)
        if self.graphs == "compile" and not (plain and self.recompute == "none"):
            raise ValueError("graphs='compile' is bf16 only, without pack, shard or recompute")
        if self.compile and self.graphs in ("step", "compile"):
            raise ValueError("compile with graphs='step' is not supported: the step graph holds "
                             "the embedding and the loss that compile would take")  # fmt: skip

    @property
    def name(self) -> str:
        fp8_named = self.precision == "fp8" and self.fp8_format != "HYBRID"
        fmt = f"-{self.fp8_format.lower()}" if fp8_named else ""
        suffix = "-compile" if self.compile else ""
        if self.precision == "fp8" and self.scaling != "delayed":
            fmt += {"current": "-current", "blockwise": "-block"}[self.scaling]
        fmt += "-fp8w" if self.fp8_weights else ""
        fmt += "-attn" if self.fp8_attention else ""
        fmt += "-bf16L" + "_".join(map(str, self.bf16_layers)) if self.bf16_layers else ""
        suffix += "-pack" if self.pack else ""
        suffix += "-shard" if self.shard else ""
        suffix += "-fsdp" if self.fsdp else ""
        suffix += f"-hsdp{self.hsdp}" if self.hsdp > 1 else ""
        suffix += "-synclast" if self.fsdp_sync == "last" else ""
        suffix += "-prefetch" if self.fsdp_prefetch else ""
        suffix += f"-recompute-{self.recompute}" if self.recompute != "none" else ""
        suffix += "-staged" if self.stage_batches else ""
        return f"{self.precision}{fmt}-{_MODE_NAMES[self.graphs]}{suffix}"

    @property
    def tokens_per_microbatch(self) -> int:
        return self.model.batch * self.model.seq_len


# Settings that checkpoints written before they existed trained with.
OLDER_DEFAULTS = {"fp8_format": "HYBRID", "scaling": "delayed", "fp8_weights": False,
                  "pack": False, "shard": False, "fp8_attention": False,
                  "bf16_layers": [], "compile": False, "fsdp": False}  # fmt: skip


def run_settings(spec: RunSpec) -> dict:
    """The settings a checkpoint records and a resumed run must share."""
    return {
        "preset": spec.preset,
        "precision": spec.precision,
        "model": spec.model.to_dict(),
        "seed": spec.seed,
        "microbatches": spec.microbatches,
        "amax_history_len": spec.amax_history_len,
        "fp8_format": spec.fp8_format,
        "scaling": spec.scaling,
        "fp8_weights": spec.fp8_weights,
        "pack": spec.pack,
        "fp8_attention": spec.fp8_attention,
        "shard": spec.shard,
        "fsdp": spec.fsdp,
        "bf16_layers": list(spec.bf16_layers),
        # torch.compile fuses the embedding and the loss into other kernels (other bits): a
        # resumed run with another --compile would not continue the saved one bit for bit.
        "compile": spec.compile,
    }
