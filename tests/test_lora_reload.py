"""A graphfp8 LoRA adapter saved with plain peft (save_pretrained) reloads with plain peft in a new
process - PeftModel.from_pretrained(graphfp8_model, dir), get_peft_model with a plain LoraConfig -
without graphfp8.lora.register (issue 39): `import graphfp8` puts graphfp8's layers in peft's LoRA
dispatch (graphfp8/lora_dispatch.py). Failed before: peft's dispatch refused a graphfp8.Linear
("Target module ... is not supported"), the config read from adapter_config.json having no custom
modules. A new process is simulated by the fixture: graphfp8's dispatch undone, then installed
as `import graphfp8` installs it."""

from __future__ import annotations

import sys

import pytest
import torch

import graphfp8 as g8
import graphfp8.lora as gl
from graphfp8 import lora_dispatch
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import TinyLM

peft = pytest.importorskip("peft")

RECIPE = g8.DelayedScaling(amax_history_len=4)
TARGETS = ["qkv", "proj"]


@pytest.fixture
def new_process():
    """peft's dispatch as a new process that imported peft and graphfp8 has it; restored after."""
    lora_dispatch.uninstall()
    lora_dispatch.install()
    yield
    lora_dispatch.uninstall()
    lora_dispatch.install()


def _base(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM("cpu")


def _saved(tmp_path) -> tuple[torch.nn.Module, torch.Tensor]:
    """A LoRA model made as graphfp8.lora's docs say (register), B random, saved by plain peft;
    returns it and a token batch."""
    config = gl.register(peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    model = peft.get_peft_model(_base(), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    return model, torch.randint(0, 64, (2, 16))


def _out(model, tokens) -> torch.Tensor:
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
        return model(tokens)


def _lora_types(model) -> dict[str, type]:
    return {n.rsplit(".", 1)[-1]: type(m) for n, m in model.named_modules()
            if n.endswith(tuple(TARGETS))}  # fmt: skip


@pytest.mark.parametrize("trainable", [False, True])
def test_plain_from_pretrained_loads_a_graphfp8_adapter(tmp_path, new_process, trainable):
    saved, tokens = _saved(tmp_path)
    want = _out(saved.eval(), tokens)
    g8.reset_state()
    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path, is_trainable=trainable).eval()
    assert _lora_types(loaded) == {"qkv": gl.LoraLayerNormLinear, "proj": gl.LoraLinear}
    assert_bitwise_equal(_out(loaded, tokens), want, "the reloaded adapter's output")
    grads = sorted(n for n, p in loaded.named_parameters() if p.requires_grad)
    assert grads == (sorted(n for n, p in saved.named_parameters() if p.requires_grad)
                     if trainable else [])  # fmt: skip


def test_get_peft_model_takes_a_plain_lora_config(new_process):
    model = peft.get_peft_model(_base(), peft.LoraConfig(r=4, target_modules=TARGETS))
    assert _lora_types(model) == {"qkv": gl.LoraLayerNormLinear, "proj": gl.LoraLinear}


def test_a_mapping_the_user_registered_wins(new_process):
    class Mine(gl.LoraLinear):
        pass

    config = peft.LoraConfig(r=4, target_modules=TARGETS)
    config._register_custom_module({g8.Linear: Mine})
    model = peft.get_peft_model(_base(), config)
    assert _lora_types(model) == {"qkv": gl.LoraLayerNormLinear, "proj": Mine}


def test_the_dispatch_is_wrapped_when_peft_loads_after_graphfp8(tmp_path, monkeypatch):
    """A stand-in for peft's module, imported after install(): the finder wraps it on load, once,
    and leaves sys.meta_path; uninstall() restores the original."""
    name = "graphfp8_test_fake_lora_model"
    (tmp_path / f"{name}.py").write_text(
        "class LoraModel:\n"
        "    @staticmethod\n"
        "    def _create_new_module(config, adapter_name, target, **kwargs):\n"
        "        return config._custom_modules\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    lora_dispatch.install(name)
    try:
        module = __import__(name)
        assert not any(getattr(f, "name", None) == name for f in sys.meta_path)
        mapped = module.LoraModel._create_new_module(peft.LoraConfig(), "default",
                                                     g8.Linear(16, 16))  # fmt: skip
        assert mapped is not None and mapped[g8.Linear] is gl.LoraLinear
        lora_dispatch.install(name)  # once: a second install wraps nothing more
        plain = torch.nn.Linear(16, 16)
        assert module.LoraModel._create_new_module(peft.LoraConfig(), "a", plain) is None
        lora_dispatch.uninstall(name)
        assert (
            module.LoraModel._create_new_module(peft.LoraConfig(), "a", g8.Linear(16, 16)) is None
        )
    finally:
        lora_dispatch.uninstall(name)
        sys.modules.pop(name, None)
        lora_dispatch.install()
