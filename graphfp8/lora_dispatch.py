"""graphfp8's layers in peft's LoRA dispatch without graphfp8.lora.register: a LoraConfig from
anywhere - PeftModel.from_pretrained's (read from adapter_config.json in a new process),
transformers' load_adapter, get_peft_model's - takes graphfp8.lora's layers for graphfp8 targets.

peft keeps custom LoRA layers on each config (LoraConfig._register_custom_module, its experimental
API) and has no registry of its own: a config loaded from disk has none, and peft's dispatch then
refuses a graphfp8.Linear ("Target module ... is not supported"). So `import graphfp8` wraps
peft's LoraModel._create_new_module, the one function every LoRA layer creation goes through: a
graphfp8 target whose class the config does not map yet gets graphfp8's mapping
(graphfp8.lora.lora_layers) added to the config first, the classes the user mapped kept as they
mapped them, then peft dispatches as always. Peft is not imported
for it: if peft's LoRA is loaded the wrap happens at once, else a finder on sys.meta_path wraps
the module when it loads (install()).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

from graphfp8.modules.base import FP8Module

__all__ = ["PEFT_MODULE", "install", "uninstall"]

PEFT_MODULE = "peft.tuners.lora.model"  # defines LoraModel
_MARK = "_graphfp8_original"


def _register_if_graphfp8(config, target) -> None:
    base = target.get_base_layer() if hasattr(target, "get_base_layer") else target
    if not isinstance(base, FP8Module):
        return
    mapped = getattr(config, "_custom_modules", None) or {}
    if not any(isinstance(base, cls) for cls in mapped):
        from graphfp8.lora import lora_layers

        # graphfp8's layers the config does not map yet (what the user mapped stays theirs)
        config._register_custom_module({k: v for k, v in lora_layers().items() if k not in mapped})


def _wrap(module) -> None:
    """Wraps module.LoraModel._create_new_module once (module: peft's, or a stand-in in tests)."""
    model = getattr(module, "LoraModel", None)
    original = None if model is None else model.__dict__.get("_create_new_module")
    if not isinstance(original, staticmethod) or hasattr(original.__func__, _MARK):
        return
    func = original.__func__

    @functools.wraps(func)
    def create(lora_config, adapter_name, target, **kwargs):
        _register_if_graphfp8(lora_config, target)
        return func(lora_config, adapter_name, target, **kwargs)

    setattr(create, _MARK, original)
    model._create_new_module = staticmethod(create)


def uninstall(module_name: str = PEFT_MODULE) -> None:
    """Undoes install() (tests: a process that never imported graphfp8)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _WrapOnLoad)]
    model = getattr(sys.modules.get(module_name), "LoraModel", None)
    current = None if model is None else model.__dict__.get("_create_new_module")
    if isinstance(current, staticmethod) and hasattr(current.__func__, _MARK):
        model._create_new_module = getattr(current.__func__, _MARK)


def install(module_name: str = PEFT_MODULE) -> None:
    """Wraps peft's dispatch now if `module_name` is loaded, else when it loads; a no-op without
    peft installed, and when done already."""
    module = sys.modules.get(module_name)
    if module is not None:
        _wrap(module)
        return
    if any(isinstance(f, _WrapOnLoad) and f.name == module_name for f in sys.meta_path):
        return
    top = module_name.partition(".")[0]
    if top in sys.modules or importlib.util.find_spec(top) is not None:
        sys.meta_path.insert(0, _WrapOnLoad(module_name))


class _WrapOnLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `name` is imported, it lets the other finders find it and runs
    _wrap after the module's code ran."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        others = [f for f in sys.meta_path if f is not self]
        for finder in others:
            spec = (
                finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            )
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader (every other attribute is its: get_source, get_filename, ...),
    with _wrap after exec_module; the finder leaves sys.meta_path then (its work is done)."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _wrap(module)
        sys.meta_path[:] = [
            f
            for f in sys.meta_path
            if not (isinstance(f, _WrapOnLoad) and f.name == module.__name__)
        ]
