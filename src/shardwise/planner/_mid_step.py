"""What the capture refuses about differentiating inside the train step, with the fix.

- `MidStepGradients`: the gradients a ``torch.autograd.grad`` that keeps the graph returned
  before the step's last backward. A plan op may not compute with one that carries a graph
  (``create_graph=True``: a gradient penalty) nor with one of a tensor other than a parameter
  (an input, an activation): the capture would take it as a whole constant, while each rank's
  gradient of its rows of that tensor holds only those rows. Gradients of parameters are one
  device's on every rank (the plan reduces them) and may be read.
- `transform_refused`: a call made inside a ``torch.func`` transform (``vmap``, ``grad``,
  ``jacrev``, ``jvp``): a plan's ops are calls on whole tensors, not on functorch's batched or
  wrapped ones.
- `functional_refused`: a ``torch.autograd.grad`` made by ``torch.autograd.functional``
  (``jvp``, ``vjp``, ``jacobian``, ``hvp``): its inner differentiations are no step's backward.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardwise._torch.functorch import current_transform
from shardwise.planner._call_kinds import call_name, grad_inputs
from shardwise.planner._graph import Node, Ref
from shardwise.planner._source_lines import source_line

T = torch.Tensor

_DATA_PARALLEL = (
    'run the step with parallel_mode="data_parallel", which runs it as written on each rank\'s rows'
)


def _outputs_of(out: Any) -> list[Any]:
    return list(out) if isinstance(out, list | tuple) else [out]


def _described(ref: Ref | None, nodes: Sequence[Node]) -> str:
    """The tensor `ref` names, for a message."""
    if ref is None or ref.kind == "const":
        return "a tensor made outside the step"
    if ref.kind == "node":
        node = nodes[int(ref.key)]
        return f"{node.name} (the output of {node.op} at {node.source})"
    return f"the step's input {ref.key}" if ref.kind == "input" else f"buffer {ref.key}"


class MidStepGradients:
    """The gradients a mid-step ``torch.autograd.grad`` returned that no plan op may read."""

    def __init__(self) -> None:
        self.refused: dict[int, tuple[T, str | None]] = {}  # id -> (tensor, what it is the
        # gradient of; None: it carries a graph)

    def note(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        out: Any,
        known: Mapping[int, Ref],
        nodes: Sequence[Node],
        graph: bool,
    ) -> None:
        """Note what ``torch.autograd.grad(*args, **kwargs)`` returned (`graph`: with
        ``create_graph=True``)."""
        for x, g in zip(grad_inputs(args, kwargs), _outputs_of(out), strict=False):
            if not isinstance(g, T):
                continue
            ref = known.get(id(x)) if isinstance(x, T) else None
            if graph:
                self.refused[id(g)] = (g, None)
            elif ref is None or ref.kind != "param":
                self.refused[id(g)] = (g, _described(ref, nodes))

    def alias(self, source: Any, out: Any) -> None:
        """`out` is `source` under another tensor object (``g.detach()``)."""
        found = self.refused.get(id(source)) if isinstance(source, T) else None
        if found is not None and found[0] is source and isinstance(out, T):
            self.refused[id(out)] = (out, found[1])

    def check(self, func: Any, ins: Sequence[T]) -> str | None:
        """The message refusing a call of `func` on `ins`, or None when it reads no refused
        gradient."""
        op = call_name(func)
        for t in ins:
            found = self.refused.get(id(t))
            if found is None or found[0] is not t:
                continue
            what = found[1]
            if what is None:
                return (
                    f"{op} at {source_line()} computes with gradients that "
                    f"torch.autograd.grad(..., create_graph=True) returned (a gradient "
                    f"penalty, a second derivative), which AutoParallel does not support"
                )
            return (
                f"{op} at {source_line()} computes with the gradient of {what} that "
                f"torch.autograd.grad(..., retain_graph=True) returned before the step's "
                f"backward: the plan would take it as one whole value, but each rank's "
                f"gradient of that tensor holds only its own block of it (its rows, or its part "
                f"of a model-parallel split), so "
                f"AutoParallel does not support computing with it in the step; use such a "
                f"gradient for monitoring only (read it after the step's backward), take "
                f"gradients of parameters (each rank's is one device's), or {_DATA_PARALLEL}"
            )
        return None


def transform_refused() -> str | None:
    """The message refusing a call made inside a ``torch.func`` transform (called from a
    recorder's hook), or None outside any."""
    transform = current_transform()
    if transform is None:
        return None
    return (
        f"{transform} at {source_line()} runs the step's code inside a torch.func (functorch) "
        f"transform while the step is captured: a plan's ops are torch calls on whole "
        f"tensors, and AutoParallel cannot plan the calls vmap / grad / jacrev / jvp make on "
        f"functorch's batched or wrapped tensors; {_DATA_PARALLEL}, or move the transform "
        f"out of the wrapped step"
    )


def functional_refused() -> str | None:
    """The message refusing a ``torch.autograd.grad`` that ``torch.autograd.functional``
    makes (called from a recorder's hook), or None when the step's own code makes it."""
    frame = sys._getframe(1)
    name = None
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.autograd.functional":
            name = frame.f_code.co_name  # (the outermost: the function the user called)
        frame = frame.f_back  # type: ignore[assignment]
    if name is None:
        return None
    return (
        f"torch.autograd.functional.{name} at {source_line()} differentiates inside the step "
        f"(it calls torch.autograd.grad on the graph, one or more times), which AutoParallel "
        f"cannot plan: a plan knows the step's own backward and gradients taken for "
        f"monitoring only; {_DATA_PARALLEL}, or compute it outside the wrapped step"
    )
