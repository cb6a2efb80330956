"""The autograd engine's private hooks: which backward runs, what it runs, what runs after it.

Gradient buckets (`parallel/_runtime.py`) and optimizer parallel (`optim/_engine_gather.py`,
`optim/_engine_reduce.py`) collect the gradients of one backward: they tell that backward
apart from a nested or a later one by its graph task id, ask whether it stores ``.grad``
(``backward()``) or only returns gradients (``torch.autograd.grad``), and finish their
collectives when it ends (a callback queued on the engine). `communication/_reductions.py`
recognises the backward node of its own autograd Function in a graph. `node_metadata` is a
graph node's own dict (documented as a method of ``torch.autograd.graph.Node``, a property on
the nodes torch makes), where `parallel/_call_io.py` marks a wrapped call's results.

The engine functions are bound once here, not wrapped: gradient hooks call them per gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""The id of the backward running on this thread (-1 outside any backward)."""

will_engine_execute_node: Callable[[Any], bool] = torch._C._will_engine_execute_node
"""Whether the running backward executes autograd node `node` (raises RuntimeError for a leaf's
accumulate-grad node inside ``torch.autograd.grad``)."""

queue_callback: Callable[[Callable[[], None]], None] = (
    torch.autograd.Variable._execution_engine.queue_callback  # type: ignore[attr-defined]
)
"""Run a callback when the running backward ends (only valid inside a backward)."""


def backward_node_class(function: type[torch.autograd.Function]) -> type[Any]:
    """The class of the graph nodes that `function`'s ``apply`` records (``grad_fn``)."""
    node_class: type[Any] = function._backward_cls  # type: ignore[attr-defined]
    return node_class


def node_metadata(node: Any) -> dict[str, Any]:
    """The metadata dict of autograd graph node `node` (a ``grad_fn``), kept with the node."""
    meta = node.metadata
    out: dict[str, Any] = meta() if callable(meta) else meta
    return out
