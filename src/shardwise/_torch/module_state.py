"""A module's own parameter and buffer tables (``Module._parameters`` / ``_buffers`` /
``_non_persistent_buffers_set``).

The public API gives a module's parameters and buffers recursively, by qualified name, and
hides which module holds a tied one. shardwise needs each module's own entries: deferred
initialization (`parameter/_deferred.py`) replaces a parameter in every module holding it and
re-registers a buffer keeping its persistence; a wrapped call (`parallel/_graph_run.py`) saves
the buffers a stopped attempt changed; capture (`planner/_capture.py`) swaps fakes in for a
while (`reparametrize`) and removes fake buffers a forward registered (`planner/_user_state.py`).

The accessors are ``operator.attrgetter``s: no slower than the attribute reads they replace.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

own_parameters: Callable[[nn.Module], dict[str, nn.Parameter | None]] = operator.attrgetter(
    "_parameters"
)
"""The parameters registered on the module itself (the live dict, by attribute name)."""

own_buffers: Callable[[nn.Module], dict[str, torch.Tensor | None]] = operator.attrgetter("_buffers")
"""The buffers registered on the module itself (the live dict, by attribute name)."""

non_persistent_buffer_names: Callable[[nn.Module], set[str]] = operator.attrgetter(
    "_non_persistent_buffers_set"
)
"""The names of the module's own buffers registered with ``persistent=False``."""


@contextmanager
def reparametrize(network: nn.Module, by_id: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """A context in which every parameter and buffer of `network` whose id is in `by_id` is
    replaced (in each module holding it: tied weights stay tied) by that tensor; the very same
    objects are put back afterwards."""
    saved = []
    for module in network.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None and id(t) in by_id:
                    saved.append((table, name, t))
                    table[name] = by_id[id(t)]  # type: ignore[assignment]
    try:
        yield
    finally:
        for table, name, t in saved:
            table[name] = t  # type: ignore[assignment]
