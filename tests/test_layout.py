"""The repository's structural rules (docs/architecture.md): imports go down the layers without
cycles, functions and files stay small."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def layers():
    return _load("check_layers")


def test_imports_follow_the_layers_without_cycles(layers):
    assert layers.violations(layers.graph(), layers.graph(type_only=True)) == []


def test_type_only_imports_count_for_cycles_not_for_layers(layers, tmp_path):
    src = tmp_path / "x.py"
    src.write_text("if TYPE_CHECKING:\n    from graphfp8.fp8 import master\n")
    name = "graphfp8.distributed.x"
    assert layers.imports_of(src, name) == set()
    assert layers.imports_of(src, name, type_only=True) == {"graphfp8.fp8.master"}
    runtime = {"graphfp8.fp8.master": {name}, name: set()}
    typed = {"graphfp8.fp8.master": {name}, name: {"graphfp8.fp8.master"}}
    assert layers.violations(runtime, typed) == [
        "import cycle: graphfp8.distributed.x -> graphfp8.fp8.master -> graphfp8.distributed.x",
        f"graphfp8.fp8.master (layer fp8) imports {name} (layer distributed, higher)",
    ]


def test_the_layer_check_catches_cycles_upward_imports_and_the_extension_around_ops(layers):
    edges = {
        "graphfp8.fp8.a": {"graphfp8.fp8.b"},
        "graphfp8.fp8.b": {"graphfp8.fp8.a", "graphfp8.graphs.capture"},
        "graphfp8.graphs.capture": {
            "graphfp8.modules.linear",
            "graphfp8.modules.base",
            "graphfp8._C",
        },
        "graphfp8.modules.base": {"graphfp8.reference"},
        "graphfp8.ops._lib": {"graphfp8._C"},
    }
    assert layers.violations(edges) == [
        "import cycle: graphfp8.fp8.a -> graphfp8.fp8.b -> graphfp8.fp8.a",
        "graphfp8.fp8.b (layer fp8) imports graphfp8.graphs.capture (layer graphs, higher)",
        "graphfp8.graphs.capture imports graphfp8._C directly, not through graphfp8.ops",
        "graphfp8.graphs.capture imports the concrete layer module graphfp8.modules.linear",
        "graphfp8.modules.base (layer modules) imports graphfp8.reference (layer root, higher)",
        "graphfp8.modules.base (runtime) imports test-only graphfp8.reference",
    ]


def test_the_top_floor_rooms_and_the_benchmarks_follow_their_rules(layers):
    edges = {
        "graphfp8.hf.convert": {"graphfp8.training.model", "graphfp8.numerics"},
        "graphfp8.te.modules": {"graphfp8"},
        "graphfp8.numerics": {"graphfp8.lora", "graphfp8.graphs"},
        "graphfp8.memory.report": {"graphfp8.testing"},
        "graphfp8.training.loop": {"graphfp8.hf", "benchmarks.common"},
        "graphfp8": {"graphfp8.hf", "graphfp8.reference"},
        "benchmarks.step": {"graphfp8.training.loop", "graphfp8.testing", "graphfp8"},
    }
    assert layers.violations(edges) == [
        "graphfp8.hf.convert (layer integrations) imports graphfp8.training.model "
        "(layer training, higher)",
        "graphfp8.memory.report (layer reports) imports graphfp8.testing (layer root, higher)",
        "graphfp8.memory.report (runtime) imports test-only graphfp8.testing",
        "graphfp8.numerics (layer reports) imports graphfp8.lora (layer integrations, higher)",
        "graphfp8.te.modules (layer integrations) imports graphfp8 (layer root, higher)",
        "graphfp8.training.loop (layer training) imports benchmarks.common (layer benchmarks, "
        "higher)",
    ]


def test_functions_and_files_stay_small():
    assert _load("check_sizes").problems() == []
