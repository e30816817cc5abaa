"""FP8 module plumbing shared by every graphfp8 layer: slots, the weight cache
(graphfp8/fp8/weight_cache.py), input checks and checkpointed FP8 state. The FP8 context is
read in modules/_context.py."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from graphfp8.fp8 import into_grad, scaling
from graphfp8.fp8 import main_grad as fused
from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.fp8.primary import INIT, quantize_block_weight, quantize_weight
from graphfp8.fp8.recipe import Recipe, is_blockwise
from graphfp8.fp8.slots import BwdRole, FwdRole, slots_per_gemm
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.fp8.weight_cache import BlockWeight, WeightCache, check_is_first_microbatch
from graphfp8.modules import _state_tensor
from graphfp8.modules._autocast import honour_autocast
from graphfp8.modules._checkpoint import check_extra_state, format_move_error, shape_errors
from graphfp8.modules._compile import eager_under_fp8, prepare_for_compile
from graphfp8.modules._context import (
    blockwise_recipe,
    blockwise_weights,
    fp8_enabled,
    gemm_configs,
    init_group,
)
from graphfp8.modules._functional import GemmConfig
from graphfp8.ops import check_gemm_dims

__all__ = ["FP8Meta", "FP8Module", "cache_weight_transposes", "check_fp8_entries",
           "fp8_entries_hook"]  # fmt: skip


class FP8Meta:
    """One module's FP8 slots (graphfp8.fp8.slots): `counts` = (forward, backward) slots, e.g.
    FwdRole and BwdRole slots per GEMM, in the forward and backward arenas."""

    def __init__(self, recipe: Recipe, device: torch.device, counts: tuple[int, int],
                 group: scaling.InitGroup | None = None):  # fmt: skip
        self.recipe = recipe
        self.device = torch.device(device)
        self.counts = counts
        self.fwd = scaling.allocate(recipe, device, scaling.FORWARD, counts[0], group)
        self.bwd = scaling.allocate(recipe, device, scaling.BACKWARD, counts[1], group)

    def __deepcopy__(self, memo) -> FP8Meta:
        """A copied module gets fresh slots holding the same histories and scales, in arenas of
        the copy (one init group per deepcopy call: the copy's modules share them)."""
        group = memo.setdefault(id(scaling.InitGroup), scaling.InitGroup())
        new = FP8Meta(self.recipe, self.device, self.counts, group)
        new.copy_from_(self)
        return new

    def copy_from_(self, other: FP8Meta) -> None:
        for mine, theirs in ((self.fwd, other.fwd), (self.bwd, other.bwd)):
            mine.history().copy_(theirs.history())
            mine.scales().copy_(theirs.scales())


class FP8Module(nn.Module):
    """Base of the graphfp8 layers. A subclass sets `num_gemms`, and its forward calls
    `_fp8_forward_configs`, which checks the input and returns the GEMM configs under
    fp8_autocast, or None: then the layer runs as an ordinary layer in its parameter dtype."""

    num_gemms = 1
    # Keep each cached FP8 weight's transpose (the dgrad GEMM's operand) beside it. False: the
    # backward transposes the cached FP8 weight instead (see cache_weight_transposes).
    cache_weight_transpose = True
    # TransformerEngine's option: each GEMM weight's gradient is added into its fp32
    # `main_grad` by the weight-gradient GEMM itself, and autograd gets none for the weight
    # (graphfp8/fp8/main_grad.py; docs/fp8.md, "Weight-gradient accumulation").
    fuse_wgrad_accumulation = False

    def __init_subclass__(cls, **kwargs) -> None:
        # torch.compile: the FP8 forward runs eagerly, never traced (modules/_compile.py);
        # torch.autocast's dtype is the activation dtype (modules/_autocast.py).
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None and not hasattr(forward, "_graphfp8_prepare"):
            cls.forward = eager_under_fp8(honour_autocast(forward), cls.__name__)

    def __init__(self) -> None:
        super().__init__()
        prepare_for_compile(type(self))
        self.fp8_meta: FP8Meta | None = None
        # Built inside fp8_model_init: its GEMM weights are FP8 (MasterWeights checks that they
        # still are: graphfp8.fp8.master.check_fp8_weights_kept).
        self._fp8_primary = INIT.enabled
        # The FP8 weight workspaces and whether they hold the current weights (eager: cast with
        # is_first_microbatch True or None; graphs decide with their device flag instead).
        self.weight_cache = WeightCache()

    # The forward preamble ----------------------------------------------------------------------

    def _fp8_forward_configs(
        self,
        inp,
        features: int,
        weights: list[tuple[str, torch.Tensor]],
        is_first_microbatch: bool | None,
        *,
        high_precision_input: bool = False,
        fp8_output: bool = False,
    ) -> list[GemmConfig] | list[BlockWeight | None] | None:
        """Checks a forward call; returns one GemmConfig per weight under fp8_autocast, one
        BlockWeight (or None: quantized in the call) per weight under Float8BlockScaling
        (modules/_blockwise.py's linear takes them), else None.

        Args:
            inp: the layer input, (..., features).
            features: the input's last dim.
            weights: (workspace key, weight (N, K)) per GEMM, in GEMM order.
            is_first_microbatch: None, True or False (see Linear.forward).
            high_precision_input: the layer needs a plain tensor (it normalizes its input).
            fp8_output: the last GEMM's output becomes a Float8Tensor.
        """
        self._check_input(inp, features, weights[0][1], high_precision_input)
        check_is_first_microbatch(is_first_microbatch)
        main_grads = fused.layer_main_grads(self, weights)  # raises before any state changes
        if not fp8_enabled():
            if any(isinstance(w, Float8Tensor) for _, w in weights):
                raise RuntimeError(
                    f"{type(self).__name__} holds FP8 primary weights (created inside "
                    "fp8_model_init): run it under fp8_autocast(enabled=True), or create it "
                    "outside fp8_model_init for a high-precision forward"
                )
            return None
        self._check_fp8_dims(inp, [w for _, w in weights])
        recipe = blockwise_recipe()
        if recipe is not None:
            self._check_blockwise(inp, weights, recipe)
            if any(isinstance(w, Float8BlockTensor) for _, w in weights):
                return None  # stored blocks, read as they are: no cache (modules/_blockwise.py)
            # The high-precision path, its GEMMs blockwise (modules/_blockwise.py).
            return blockwise_weights(self, weights, is_first_microbatch)
        if any(isinstance(w, Float8BlockTensor) for _, w in weights):
            raise RuntimeError(
                f"{type(self).__name__} holds blockwise FP8 primary weights (created inside "
                "fp8_model_init(recipe=Float8BlockScaling())): run it under "
                "fp8_autocast(recipe=Float8BlockScaling()), or create it under the recipe it runs"
            )
        configs = gemm_configs(self, weights, is_first_microbatch, fp8_output)
        for cfg, (_, w), g in zip(configs, weights, main_grads, strict=True):
            cfg.main_grad = None if g is None else (w, g)
            # The parameter whose .grad the wgrad GEMM may write (fp8/into_grad.py); kept off
            # the backward's context without the switch.
            cfg.weight = w if into_grad.switched_on() else None
        return configs

    def _wgrad_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight of a high-precision or blockwise GEMM: under fuse_wgrad_accumulation (and
        grad) a view whose gradient is added into its main_grad (checked by the preamble); the
        add is a separate pass there, only the per-tensor FP8 GEMM fuses it."""
        if not (self.fuse_wgrad_accumulation and torch.is_grad_enabled() and weight.requires_grad):
            return weight
        return fused.route_to_main_grad(weight, weight.main_grad)

    def _check_blockwise(self, inp, weights, recipe: Recipe) -> None:
        """What Float8BlockScaling does not take (it quantizes high-precision tensors at each
        GEMM, the weights into its own cache: fp8/weight_cache.py's BlockWorkspace; a blockwise
        FP8 primary weight's blocks are read as they are stored)."""
        name = type(self).__name__
        for _, w in weights:
            if not isinstance(w, Float8Tensor):
                continue
            if not isinstance(w, Float8BlockTensor):
                raise RuntimeError(
                    f"{name}: its FP8 primary weights are stored per tensor (fp8_model_init "
                    "under a per-tensor recipe) and do not run under Float8BlockScaling; create "
                    "the model inside fp8_model_init(recipe=Float8BlockScaling())"
                )
            if w._power_2_scale != recipe.power_2_scale:
                raise RuntimeError(
                    f"{name}: its blockwise FP8 weights hold power_2_scale={w._power_2_scale} "
                    f"scales, the recipe asks for power_2_scale={recipe.power_2_scale}; create "
                    "the model inside fp8_model_init with the recipe it runs under"
                )
        if isinstance(inp, Float8Tensor):
            raise TypeError(
                f"{name}: Float8BlockScaling takes high-precision inputs, got a Float8Tensor "
                "(an fp8_output of a layer run under another recipe)"
            )

    # FP8 state -------------------------------------------------------------------------------

    def uses_fp8(self, recipe: Recipe) -> bool:
        """Whether this module owns FP8 slots under `recipe` (blockwise scaling keeps none)."""
        return not is_blockwise(recipe)

    def _slot_counts(self) -> tuple[int, int]:
        """(forward, backward) slots this module owns: the GEMM roles of each of its GEMMs."""
        return slots_per_gemm(FwdRole) * self.num_gemms, slots_per_gemm(BwdRole) * self.num_gemms

    def fp8_init(self, recipe: Recipe, device, group: scaling.InitGroup | None = None) -> FP8Meta:
        """Allocates this module's slots for `recipe` in `group`'s arenas (None: the current FP8
        context's init group; graphfp8/fp8/scaling.py) - or moves them to it from another recipe
        of the same history length - and returns them."""
        meta, device = self.fp8_meta, torch.device(device)
        if meta is not None and meta.recipe == recipe and meta.device == device:
            return meta
        name = type(self).__name__
        if meta is not None:
            if meta.recipe.amax_history_len != recipe.amax_history_len:
                raise ValueError(
                    f"{name}: its FP8 state has amax_history_len="
                    f"{meta.recipe.amax_history_len}, the recipe asks for "
                    f"{recipe.amax_history_len}; history lengths cannot change "
                    f"({type(meta.recipe).__name__} -> {type(recipe).__name__}; "
                    "Float8CurrentScaling keeps one-long histories)"
                )
            if meta.fwd.arena.frozen:
                raise RuntimeError(
                    f"{name}: its FP8 state is captured in a graph for {meta.recipe} and cannot "
                    f"move to {recipe}"
                )
            moved = format_move_error(meta.recipe, recipe, meta.bwd.history(), meta.bwd.scales())
            if moved is not None:
                raise ValueError(f"{name}: {moved}")
        new = FP8Meta(recipe, device, self._slot_counts(), group or init_group())
        if meta is not None:
            new.copy_from_(meta)
        self.fp8_meta = new
        return new

    def fp8_snapshot(self) -> tuple:
        """This module's FP8 slots and weight cache, for restore_fp8() (a capture that fails
        puts them back)."""
        return self.fp8_meta, self.weight_cache.snapshot()

    def restore_fp8(self, snap: tuple) -> None:
        meta, cache = snap
        self.fp8_meta = meta
        self.weight_cache.restore(cache)

    # Checks --------------------------------------------------------------------------------------

    def _check_input(self, inp, features: int, weight: torch.Tensor, high_precision: bool) -> None:
        name = type(self).__name__
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"{name}: input must be a tensor, got {type(inp).__name__}")
        if inp.dim() < 1 or inp.shape[-1] != features:
            raise ValueError(f"{name}: expected input (..., {features}), got {tuple(inp.shape)}")
        if inp.dtype != weight.dtype:
            raise TypeError(
                f"{name}: input dtype {inp.dtype} does not match the parameters' {weight.dtype}"
            )
        if inp.device != weight.device:
            raise ValueError(
                f"{name}: input is on {inp.device} but the parameters are on {weight.device}"
            )
        if isinstance(inp, Float8Tensor):
            if high_precision:
                raise TypeError(f"{name}: the normalization needs a high-precision input")
            if not fp8_enabled():
                raise TypeError(f"{name}: a Float8Tensor input needs fp8_autocast(enabled=True)")

    def _check_fp8_dims(self, inp: torch.Tensor, weights: list[torch.Tensor]) -> None:
        """FP8 GEMMs need float32/bfloat16/float16 weights, K and N multiples of 16, and the
        token count a multiple of 16 too when the weight gradient (whose inner dim is the token
        count) will be computed."""
        name = type(self).__name__
        for w in weights:
            if w.dtype not in FP8_PARAM_DTYPES:
                raise TypeError(
                    f"{name}: FP8 needs float32, bfloat16 or float16 parameters, got {w.dtype} "
                    "(params_dtype)"
                )
            check_gemm_dims(w.shape[1], w.shape[0], name)
        tokens = inp.numel() // inp.shape[-1]
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights) and tokens % 16:
            raise ValueError(
                f"{name}: FP8 training needs the token count (the product of the input's "
                f"leading dims) to be a multiple of 16 for the weight-gradient GEMM, got {tokens}"
                ": pad every batch to a multiple of 16 tokens (the tokenizer's or the data "
                "collator's pad_to_multiple_of=16, which covers an epoch's last partial batch "
                "too; padding is masked by attention_mask and labels -100), or drop the last "
                "partial batch (DataLoader(drop_last=True))"
            )

    # Checkpoints ---------------------------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        """.to(), .cuda(), .half() and friends: an FP8 primary weight they would change raises
        (its replacement would be a high-precision copy that MasterWeights never sees)."""
        for name, p in self._parameters.items():
            if isinstance(p, Float8Tensor) and fn(p) is not p:
                raise RuntimeError(
                    f"{type(self).__name__}: FP8 primary weight {name} cannot be moved or cast "
                    "(.to/.cuda/.half); create the model on its device and params_dtype inside "
                    "fp8_model_init"
                )
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # fmt: skip
        """Checks this module's whole entry first - FP8 state, recipe, history length, shapes -
        so a checkpoint it cannot take changes nothing of it (an FP8 state error raises, a
        shape is reported as torch reports it). Its weights without FP8 state (a high-precision
        checkpoint) load as fresh FP8 state. A high-precision checkpoint entry for an FP8
        primary weight is quantized (its scale from its own amax, as fp8_model_init does); FP8
        entries copy bit for bit. The cached FP8 weights are stale afterwards."""
        key = prefix + "_extra_state"
        if key not in state_dict and any(prefix + n in state_dict for n in self._parameters):
            state_dict[key] = None  # this module's weights without FP8 state: fresh FP8 state
        extra = state_dict.get(key)
        if not _state_tensor.is_empty(extra):
            check_extra_state(self, extra, f"{type(self).__name__} {prefix[:-1]}".rstrip())
        errors = shape_errors(self, state_dict, prefix)
        if errors:
            error_msgs.extend(errors)
            return
        for name, p in self._parameters.items():
            entry = state_dict.get(prefix + name)
            if (
                isinstance(p, Float8Tensor)
                and isinstance(entry, torch.Tensor)
                and not isinstance(entry, Float8Tensor)
            ):
                hp = entry.to(device=p.device, dtype=p.dtype)
                state_dict[prefix + name] = (
                    quantize_block_weight(hp, p._power_2_scale)
                    if isinstance(p, Float8BlockTensor)
                    else quantize_weight(hp, p.fp8_dtype)
                )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)  # fmt: skip
        self.weight_cache.invalidate()

    def get_extra_state(self) -> torch.Tensor:
        """This module's FP8 state as one float32 tensor (modules/_state_tensor.py)."""
        meta = self.fp8_meta
        if meta is None:
            return _state_tensor.none()
        return _state_tensor.encode(meta.recipe, meta.fwd.history(), meta.fwd.scales(),
                                    meta.bwd.history(), meta.bwd.scales())  # fmt: skip

    def set_extra_state(self, state) -> None:
        """Loads a checkpoint's FP8 state (checked first: check_extra_state), a tensor or an older
        graphfp8's dict. No state resets this module's slots, as a fresh module holds them."""
        if _state_tensor.is_empty(state):
            if self.fp8_meta is not None:
                for block in (self.fp8_meta.fwd, self.fp8_meta.bwd):
                    block.history().zero_()
                    block.scales().fill_(1.0)
            self.weight_cache.invalidate()
            return
        state = check_extra_state(self, state, type(self).__name__)
        device = next(itertools.chain(self.parameters(), self.buffers())).device
        meta = self.fp8_init(state["recipe"], device)
        for key, block in (("fwd", meta.fwd), ("bwd", meta.bwd)):
            block.history().copy_(state[f"{key}_amax_history"])
            block.scales().copy_(state[f"{key}_scale"])
        self.weight_cache.invalidate()


def check_fp8_entries(root: nn.Module, state_dict: dict, prefix: str = "") -> None:
    """Checks the FP8 state entry of every graphfp8 layer under `root` (check_extra_state)
    before any module loads: a model's load_state_dict pre-hook (from_hf and convert register
    it), so that a checkpoint one layer refuses leaves every layer as it was (torch loads module
    by module and would have written the layers before it).

    Args:
        root: the module being loaded; state_dict, prefix: as torch passes them to the hook.
    """
    for path, m in root.named_modules(prefix=prefix[:-1] if prefix else ""):
        if isinstance(m, FP8Module) and m is not root:
            extra = state_dict.get(f"{path}._extra_state" if path else "_extra_state")
            if not _state_tensor.is_empty(extra):
                check_extra_state(m, extra, f"{type(m).__name__} {path}".rstrip())


def fp8_entries_hook(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """check_fp8_entries as a load_state_dict pre-hook."""
    check_fp8_entries(module, state_dict, prefix)


def cache_weight_transposes(module: nn.Module, enabled: bool) -> None:
    """Whether the FP8 layers in `module` keep each cached FP8 weight's transpose beside it.

    With False the weight cache holds 1 byte per weight element instead of 2, and every
    backward transposes the cached FP8 weight for its dgrad GEMM (one FP8 transpose per GEMM,
    its output freed after the GEMM): the same bits, more memory traffic. Set it before the
    layers' first FP8 call or capture: a captured graph keeps the workspaces it was captured with.
    """
    for m in module.modules():
        if isinstance(m, FP8Module):
            m.cache_weight_transpose = enabled


FP8_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
