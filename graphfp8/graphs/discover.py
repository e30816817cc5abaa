"""What a callable reaches beyond its own arguments: the modules a plain function closes over, and
the tensors requiring grad that its outputs depend on without being its inputs or parameters.

A graph's backward computes gradients only for the tensors it was told about. A plain function
that closes over a module (`lambda x: model(x) * 2`) has no parameters of its own; left at that,
its outputs would come back without requires_grad and the module's parameters without gradient.
So the capturer walks the autograd graph of the captured forward: every leaf requiring grad that
it reaches is adopted as a parameter of the callable (its gradient goes to `.grad`, as eagerly),
and a tensor requiring grad that was computed outside the callable, whose gradient the graph
cannot pass on, raises.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

__all__ = ["adopt_outside_leaves", "closure_modules", "next_sequence_nr", "outside_leaves"]


def closure_modules(func, depth: int = 3) -> list[nn.Module]:
    """Modules a plain function can reach: bound `self`, functools.partial arguments, closure
    cells and the globals its code names, following nested functions `depth` levels deep."""
    found: dict[int, nn.Module] = {}
    seen: set[int] = set()

    def visit(obj, level: int) -> None:
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, functools.partial):
            for item in (obj.func, *obj.args, *obj.keywords.values()):
                visit(item, level + 1)
        elif isinstance(obj, types.MethodType):
            visit(obj.__self__, level)
            visit(obj.__func__, level)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, level + 1)
                except ValueError:  # an empty cell
                    pass
            for name in obj.__code__.co_names:
                if name in obj.__globals__:
                    visit(obj.__globals__[name], level + 1)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, level + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, level + 1)

    visit(func, 0)
    return list(found.values())


def next_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread gets: nodes of a
    forward run after this call have this number or a higher one."""
    with torch.enable_grad():
        probe = torch.empty(0, requires_grad=True).view(0)
    return probe.grad_fn._sequence_nr() + 1


def outside_leaves(outputs, inputs, known, since: int) -> tuple[list[torch.Tensor], list[str]]:
    """Walks the autograd graph from `outputs` back to where it leaves the callable.

    Args:
        outputs: the callable's output tensors.
        inputs: its input tensors (the walk stops at them).
        known: tensors whose gradients are already computed (its parameters).
        since: next_sequence_nr() taken before the forward ran.

    Returns:
        (leaves, foreign): leaf tensors requiring grad that are neither inputs nor known, in
        the order found; names of autograd nodes created before the forward (tensors computed
        outside the callable that require grad).
    """
    stop = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    skip = {id(t) for t in inputs} | {id(t) for t in known}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: dict[int, object] = {}  # holds the node wrappers, so that their ids stay unique
    leaves, foreign = [], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf
            if id(variable) not in skip:
                skip.add(id(variable))
                leaves.append(variable)
            continue
        if node._sequence_nr() < since:
            foreign.append(node.name())
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves, foreign


def adopt_outside_leaves(runner, outputs, since: int) -> None:
    """Adds to runner.params the leaves requiring grad that `outputs` depend on beyond the
    runner's inputs and parameters, named after the closed-over module that owns them; raises
    for tensors requiring grad computed outside. since: next_sequence_nr() before the call."""
    leaves, foreign = outside_leaves(outputs, runner.static_inputs, runner.params, since)
    if foreign:
        raise RuntimeError(
            f"{runner.name}: its outputs depend on tensors that require grad but were computed "
            f"before the call (autograd nodes {foreign}); a graph cannot pass gradients on to "
            "them. Pass such tensors as arguments (in sample_args), or detach them"
        )
    owners = {
        id(p): f"{type(m).__name__}.{n}" for m in runner.closure for n, p in m.named_parameters()
    }
    runner.adopt(leaves, [owners.get(id(p), _unowned(p)) for p in leaves])


def _unowned(t: torch.Tensor) -> str:
    return f"a {tuple(t.shape)} {t.dtype} tensor outside the callable"
