"""A Lightning precision plugin that trains in FP8 with graphfp8, the shape of Lightning's
TransformerEnginePrecision (its arguments), for the Trainer and for Fabric:

    from graphfp8.lightning import FabricFP8Precision, FP8Precision
    trainer = L.Trainer(plugins=[FP8Precision(weights_dtype=torch.bfloat16)],
                        accumulate_grad_batches=4)
    fabric = L.Fabric(plugins=[FabricFP8Precision(weights_dtype=torch.bfloat16)])

convert_module swaps the model's nn.Linear layers for graphfp8.Linear (graphfp8.convert; layers
whose features are not multiples of 16 stay, with a warning, as TransformerEngine's plugin
does) unless it holds graphfp8 layers already (replace_layers=False: never). forward_context
runs each training, validation and prediction step through the carried recipe's one entrance
(FP8Carry.region, graphfp8.modules.carry): FP8 with the recipe, the FP8 weights cast from their
current values on every training step, validation and prediction leaving the FP8 training state
as it was (in FP8 unless eval_fp8=False). Needs
`lightning` (or `pytorch_lightning`); importing graphfp8 does not import it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping

import torch
from lightning_utilities import apply_to_collection

from graphfp8.fp8.recipe import DelayedScaling, Format, Recipe
from graphfp8.modules.base import FP8Module, check_fp8_entries
from graphfp8.modules.carry import FP8Carry, init_fp8_state
from graphfp8.modules.convert import convert

try:
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import Precision
except ImportError:  # the standalone packages (pytorch-lightning, lightning-fabric)
    from lightning_fabric.plugins.precision import Precision as FabricPrecision
    from pytorch_lightning.plugins.precision import Precision

__all__ = ["FP8Precision", "FabricFP8Precision"]


def _recipe(recipe) -> Recipe:
    """A graphfp8 recipe, or DelayedScaling's arguments as a mapping (fp8_format by name), as
    TransformerEnginePrecision takes them."""
    if recipe is None:
        return DelayedScaling()
    if isinstance(recipe, Mapping):
        args = dict(recipe)
        if isinstance(args.get("fp8_format"), str):
            args["fp8_format"] = Format[args["fp8_format"]]
        return DelayedScaling(**args)
    return recipe


def _fp8_shaped(linear: torch.nn.Linear, name: str) -> bool:
    if linear.in_features % 16 or linear.out_features % 16:
        warnings.warn(f"graphfp8 FP8Precision: {name!r} ({linear.in_features} -> "
                      f"{linear.out_features} features, not multiples of 16) stays a "
                      "torch.nn.Linear in high precision", stacklevel=3)  # fmt: skip
        return False
    return True


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _FP8:
    """FP8 training with graphfp8 in Lightning (FP8Precision: the Trainer's; FabricFP8Precision:
    Fabric's).

    Args:
        weights_dtype: the parameters' dtype (torch.bfloat16 for FP8 training).
        recipe: a graphfp8 recipe, or DelayedScaling's arguments as a mapping; default
            DelayedScaling().
        replace_layers: convert nn.Linear layers (None: unless the model has graphfp8 layers).
        fallback_compute_dtype: torch.autocast's dtype for the other ops (default weights_dtype:
            no autocast).
        fp8_group, eval_fp8: graphfp8.modules.carry.FP8Carry's.
    """

    precision = "graphfp8-fp8"

    def __init__(self, *, weights_dtype: torch.dtype = torch.bfloat16, recipe=None,
                 replace_layers: bool | None = None,
                 fallback_compute_dtype: torch.dtype | None = None, fp8_group=None,
                 eval_fp8: bool = True) -> None:  # fmt: skip
        self.weights_dtype = weights_dtype
        self.carry = FP8Carry(_recipe(recipe), fp8_group, eval_fp8)
        self.recipe = self.carry.recipe
        self.replace_layers = replace_layers
        self.fallback_compute_dtype = fallback_compute_dtype or weights_dtype
        self._module: torch.nn.Module | None = None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        has_fp8 = any(isinstance(m, FP8Module) for m in module.modules())
        if self.replace_layers is True or (self.replace_layers is None and not has_fp8):
            convert(module, module_filter=_fp8_shaped)
        module = module.to(dtype=self.weights_dtype)
        param = next(module.parameters(), None)
        init_fp8_state(module, self.recipe, param.device if param is not None else "cpu")
        self._module = module
        return module

    def tensor_init_context(self):
        return _default_dtype(self.weights_dtype)

    def module_init_context(self):
        return _default_dtype(self.weights_dtype)

    def forward_context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(_default_dtype(self.weights_dtype))
        if self.fallback_compute_dtype != self.weights_dtype:
            param = next(self._module.parameters()) if self._module is not None else None
            device = param.device.type if param is not None else "cuda"
            stack.enter_context(torch.autocast(device, dtype=self.fallback_compute_dtype))
        stack.enter_context(self.carry.region(self._module))
        return stack

    def convert_input(self, data):
        return _floats_to(data, self.weights_dtype)

    def convert_output(self, data):
        return _floats_to(data, torch.get_default_dtype())


# The checkpoint entry that holds the FP8 state of the Trainer's checkpoints (FP8Precision).
FP8_STATE_KEY = "graphfp8_fp8_state"


class FP8Precision(_FP8, Precision):
    __doc__ = _FP8.__doc__

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Lightning's Trainer restores fit(ckpt_path=)'s model state before this plugin converts
        the model (the unconverted one has no FP8 state: "unexpected _extra_state keys"), so
        the graphfp8 layers' FP8 state moves from checkpoint["state_dict"] to
        checkpoint[FP8_STATE_KEY], and on_load_checkpoint loads it after the conversion."""
        if self._module is None or "state_dict" not in checkpoint:
            return
        state = checkpoint["state_dict"]
        keys = {f"{n}._extra_state" if n else "_extra_state"
                for n, m in self._module.named_modules() if isinstance(m, FP8Module)}  # fmt: skip
        fp8 = {k: state.pop(k) for k in [k for k in state if k in keys]}
        if fp8:
            checkpoint[FP8_STATE_KEY] = fp8

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Loads the FP8 state on_save_checkpoint set aside into the converted model (checked
        for every layer before any loads: graphfp8.modules.base.check_fp8_entries)."""
        fp8 = checkpoint.get(FP8_STATE_KEY)
        if not fp8 or self._module is None:
            return
        check_fp8_entries(self._module, fp8)
        result = self._module.load_state_dict(fp8, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(
                f"graphfp8 FP8Precision: the checkpoint holds FP8 state for layers this model "
                f"does not have as graphfp8 layers: {result.unexpected_keys[:4]}; convert the "
                "same layers as the run that saved it (replace_layers, layer shapes)"
            )


class FabricFP8Precision(_FP8, FabricPrecision):
    __doc__ = _FP8.__doc__


def _floats_to(data, dtype: torch.dtype):
    """Floating-point tensors in a (nested) batch cast to `dtype`; integers (token ids) kept."""
    return apply_to_collection(
        data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t
    )
