"""What an autograd graph keeps for its backward: every node reachable from some outputs, and the
tensors it holds - a built-in node's `_saved_*` attributes, a custom Function's saved_tensors
and whatever tensors it keeps on ctx besides them (FP8 weight transposes, configs) - each
storage counted once through the report's Ledger."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphfp8.memory.ledger import Claim, Ledger

__all__ = ["NodeSaves", "walk_saved"]

SAVED = "saved activations"
_MAX_DEPTH = 4  # how deep ctx attributes are searched for tensors (configs hold views)


@dataclass
class NodeSaves:
    """One autograd node and the tensors it keeps for its backward.

    Attributes:
        node: the node's type, e.g. "_FP8LinearBackward", "NativeLayerNormBackward0".
        module: the module whose parameters or FP8 weights the node refers to ("" if none).
        tensors: every tensor it keeps, counted or found counted already.
    """

    node: str
    module: str
    tensors: list[Claim]

    @property
    def counted_bytes(self) -> int:
        return sum(c.nbytes for c in self.tensors if c.counted)

    def to_dict(self) -> dict:
        return {"node": self.node, "module": self.module, "bytes": self.counted_bytes,
                "tensors": [c.to_dict() for c in self.tensors]}  # fmt: skip


def walk_saved(outputs, ledger: Ledger) -> list[NodeSaves]:
    """Every node of the graph behind `outputs` (breadth first, from the outputs), with what it
    saves. Storages not claimed yet are counted as saved activations.

    Args:
        outputs: a tensor or an iterable of tensors (those without grad_fn are skipped).
        ledger: storages claimed so far (parameters, FP8 weights, graph buffers, ...).
    """
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    queue = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen, found = set(), []
    while queue:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        claims = []
        for label, t in _node_tensors(node):
            claims += ledger.claim(t, SAVED, label)
        if claims:
            found.append(NodeSaves(type(node).__name__, _module_of(claims), claims))
        queue.extend(fn for fn, _ in node.next_functions)
    return found


def _module_of(claims: list[Claim]) -> str:
    """The module owning the first parameter (or FP8 weight) among a node's tensors: the report
    labels those by module path ("layers.0.mlp.fc1_weight", "layers.0.mlp.fc1.data")."""
    for owner, cut in (("parameters", 1), ("FP8 weights", 2)):
        for c in claims:
            if not c.counted and c.owner == owner and "." in c.first_label:
                return c.first_label.rsplit(".", cut)[0]
    return ""


def _node_tensors(node):
    """(label, tensor) for everything the node keeps. Raises nothing for freed saves."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):  # a custom Function's ctx
        try:
            saved = node.saved_tensors
        except RuntimeError:  # already freed by a backward
            saved = ()
        for i, t in enumerate(saved):
            if isinstance(t, torch.Tensor):
                yield f"saved_tensors[{i}]", t
        for name, value in vars(node).items():
            yield from _search(value, f"ctx.{name}", 0, set())
        return
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue
        yield from _search(value, name, _MAX_DEPTH, set())  # tensors or tuples of them only


def _search(value, label: str, depth: int, seen: set):
    """Tensors inside value: itself, tuples/lists/dicts, and graphfp8 objects (configs, slot
    blocks) up to _MAX_DEPTH levels. Graph runners are skipped: the report counts graphs
    separately."""
    if isinstance(value, torch.Tensor):
        yield label, value
        return
    if depth > _MAX_DEPTH or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _search(item, f"{label}[{i}]", depth + 1, seen)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _search(item, f"{label}[{key!r}]", depth + 1, seen)
    elif _is_graphfp8_object(value):
        for name, item in _attributes(value):
            yield from _search(item, f"{label}.{name}", depth + 1, seen)


def _is_graphfp8_object(value) -> bool:
    module = type(value).__module__
    return module.startswith("graphfp8.") and not module.startswith("graphfp8.graphs")


def _attributes(value):
    names = list(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if s not in names]
    for name in names:
        if hasattr(value, name):
            yield name, getattr(value, name)
