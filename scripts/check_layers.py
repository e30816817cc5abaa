"""Checks graphfp8's import graph: no cycles between modules, and every import goes down the
layers of docs/architecture.md, the top floor's rooms included; the repository's benchmarks/ are
checked as a client of the package. Prints the graph's violations; exit status 1 if there are any.

    python scripts/check_layers.py [--graph]     (--graph also prints every module's imports)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphfp8"
# Clients of the package, outside it: they may import anything in graphfp8, graphfp8 never them.
CLIENTS = (ROOT / "benchmarks",)

# Lowest first; a module may import its own layer and the layers below. Names are prefixes of
# dotted module names (the longest matching prefix wins).
LAYERS = [
    (
        "base",
        [
            "graphfp8.ops",
            "graphfp8._C",
            "graphfp8.nvtx_ranges",
            "graphfp8.global_state",
        ],
    ),
    ("fp8", ["graphfp8.fp8"]),
    ("distributed", ["graphfp8.distributed"]),
    ("modules", ["graphfp8.modules"]),
    ("graphs", ["graphfp8.graphs"]),
    # The top floor's rooms: reports never import integrations or the training app;
    # integrations never import the training app (nor the benchmarks: no runtime module does).
    ("reports", ["graphfp8.memory", "graphfp8.numerics", "graphfp8.numerics_blockwise"]),
    (
        "integrations",
        [
            "graphfp8.hf",
            "graphfp8.te",
            "graphfp8.lora",
            "graphfp8.lora_dispatch",
            "graphfp8.lora_hf",
            "graphfp8.lightning",
        ],
    ),
    ("training", ["graphfp8.training"]),
    ("root", ["graphfp8"]),  # the package's __init__ (public names) and the test-only twins
    ("benchmarks", ["benchmarks"]),
]
RUNTIME_TOP = "training"  # the highest layer that ships as runtime code
# Test-only code that runtime layers must never import (benchmarks and the package root may).
TEST_ONLY = ("graphfp8.reference", "graphfp8.testing")
# graphs/ knows only the module base class, never a concrete layer.
GRAPHS_MAY_IMPORT = ("graphfp8.modules.base",)
# The compiled extension is loaded by graphfp8.ops (its loader, ops/_lib.py) and reached through it.
EXTENSION, EXTENSION_LOADER = "graphfp8._C", "graphfp8.ops"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, type_only: bool = False) -> set[str]:
    """graphfp8 modules that `path` imports at module level or inside functions; with type_only,
    also those under `if TYPE_CHECKING:` (annotations: a cycle, not a layering edge)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in _runtime_nodes(tree, type_only):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(_NAMES))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            if not base.startswith(_NAMES):
                continue
            for alias in node.names:  # `from graphfp8 import ops` imports graphfp8.ops
                sub = f"{base}.{alias.name}"
                found.add(sub if _exists(sub) else base)
    return found - {name}


def _runtime_nodes(tree: ast.AST, type_only: bool = False):
    """Every node outside `if TYPE_CHECKING:` blocks (every node with type_only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if not type_only and isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


_NAMES = ("graphfp8", "benchmarks")  # the imports that are edges of the graph


def _exists(name: str) -> bool:
    if name == "graphfp8._C":  # the compiled extension, built or not
        return True
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def layer_of(name: str) -> int:
    best, best_len = len(LAYERS) - 1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def graph(type_only: bool = False) -> dict[str, set[str]]:
    paths = [p for folder in (PACKAGE, *CLIENTS) for p in sorted(folder.rglob("*.py"))]
    return {module_name(p): imports_of(p, module_name(p), type_only) for p in paths}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each reported once, from its smallest node)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :]
                i = cycle.index(min(cycle))
                cycle = cycle[i:] + cycle[:i]
                if cycle not in found:
                    found.append(cycle)
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return found


def _is_package_of(importer: str, imported: str) -> bool:
    """A package's __init__ re-exporting its own submodules is not a layering edge."""
    return imported.startswith(importer + ".")


_RUNTIME_TOP = [name for name, _ in LAYERS].index(RUNTIME_TOP)


def violations(edges: dict[str, set[str]], typed: dict[str, set[str]] | None = None) -> list[str]:
    """Human-readable problems: cycles (over `typed`, the edges with type-only imports, when
    given), upward imports, test-only imports, concrete layers imported by graphs/, the
    extension imported around its loader."""
    out = []
    # Package __init__ files import their children: leave those edges out of the cycle search.
    typed = edges if typed is None else typed
    plain = {m: {i for i in deps if not _is_package_of(m, i)} for m, deps in typed.items()}
    for cycle in _cycles(plain):
        out.append("import cycle: " + " -> ".join(cycle + cycle[:1]))
    for mod, deps in sorted(edges.items()):
        for dep in sorted(deps):
            if _is_package_of(mod, dep) or dep.startswith(mod + "."):
                continue
            if layer_of(dep) > layer_of(mod):
                out.append(
                    f"{mod} (layer {LAYERS[layer_of(mod)][0]}) imports {dep} "
                    f"(layer {LAYERS[layer_of(dep)][0]}, higher)"
                )
            runtime = layer_of(mod) <= _RUNTIME_TOP
            if runtime and dep.startswith(TEST_ONLY):
                out.append(f"{mod} (runtime) imports test-only {dep}")
            if dep == EXTENSION and not mod.startswith(EXTENSION_LOADER):
                out.append(f"{mod} imports {dep} directly, not through {EXTENSION_LOADER}")
            if mod.startswith("graphfp8.graphs") and dep.startswith("graphfp8.modules"):
                if dep not in GRAPHS_MAY_IMPORT:
                    out.append(f"{mod} imports the concrete layer module {dep}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true", help="print every module's imports")
    args = parser.parse_args(argv)
    edges = graph()
    if args.graph:
        for mod, deps in edges.items():
            print(f"{mod} [{LAYERS[layer_of(mod)][0]}] -> {', '.join(sorted(deps)) or '-'}")
    problems = violations(edges, graph(type_only=True))
    for line in problems:
        print(line)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, "
          f"{len(problems)} problem(s)")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
