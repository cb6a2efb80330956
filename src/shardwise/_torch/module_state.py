"""A module's own parameter and buffer tables (``Module._parameters`` / ``_buffers`` /
``_non_persistent_buffers_set``).

The public API gives a module's parameters and buffers recursively, by qualified name, and
hides which module holds a tied one. shardwise needs each module's own entries: deferred
initialization (`parameter/_deferred.py`) replaces a parameter in every module holding it and
re-registers a buffer keeping its persistence; a wrapped call (`parallel/_graph_run.py`) saves
the buffers a stopped attempt changed; capture (`planner/_capture.py`) swaps fakes in for a
while (`reparametrize`) and removes fake buffers a forward registered (`planner/_user_state.py`).

`hook_functions` lists the forward and backward (pre-)hooks a module runs: its own
(``Module._forward_hooks`` and the like) and those registered for every module
(``torch.nn.modules.module._global_forward_hooks`` and the like), for the capture to put back
the Python state they change (`parallel/_discover.hook_objects`).

The accessors are ``operator.attrgetter``s: no slower than the attribute reads they replace.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

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


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hook_functions(modules: Iterable[nn.Module]) -> list[Callable[..., Any]]:
    """The forward and backward hooks and pre-hooks registered on each of `modules` and those
    registered for all modules (``register_module_forward_hook`` and the like), each once."""
    tables: list[Mapping[int, Callable[..., Any]]] = [
        getattr(_module, "_global" + name) for name in _HOOK_TABLES
    ]
    for m in modules:
        tables += [getattr(m, name, {}) for name in _HOOK_TABLES]
    found = {id(hook): hook for table in tables for hook in list(table.values())}
    return list(found.values())
