"""torch's pytree: flattening nested containers of tensors (``torch.utils._pytree``).

shardwise flattens a call's arguments and results the way torch does (capture, the plan
executor, DTensor's argument specs), so that a user's containers (namedtuples, dataclasses
registered with torch, ``torch.Size``) flatten alike everywhere; torch has no public pytree
module. The functions are torch's own objects (``pytree.tree_leaves`` costs what it did);
`tree_map_dataclasses` maps a wrapper's result as it is returned: also inside plain
dataclasses torch does not flatten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.utils._pytree import (
    SUPPORTED_NODES,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_map_only,
    tree_structure,
    tree_unflatten,
)

__all__ = [
    "SUPPORTED_NODES",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_map_dataclasses",
    "tree_map_only",
    "tree_structure",
    "tree_unflatten",
]


def tree_map_dataclasses(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`tree_map` that also enters dataclasses, registered or not (Hugging Face's
    ``ModelOutput``, a plain ``@dataclass`` torch does not flatten): `fn` maps each field's
    leaves, and the instance is rebuilt by ``dataclasses.replace`` where an init field changed,
    its other fields (``field(init=False)``) set to their mapped values after (the same object
    where no field changed).

    Example:
        >>> tree_map_dataclasses(lambda t: t * 2, {"out": Out(loss=torch.tensor(1.0))})
        {'out': Out(loss=tensor(2.))}
    """

    def leaf(x: Any) -> Any:
        if not dataclasses.is_dataclass(x) or isinstance(x, type):
            return fn(x)
        fields = [f for f in dataclasses.fields(x) if hasattr(x, f.name)]
        before = {f.name: getattr(x, f.name) for f in fields}
        after = {k: tree_map_dataclasses(fn, v) for k, v in before.items()}
        if all(after[k] is before[k] for k in before):
            return x
        made = dataclasses.replace(x, **{f.name: after[f.name] for f in fields if f.init})
        for f in fields:
            if not f.init:  # (set after construction: ``__post_init__`` or the user's code)
                object.__setattr__(made, f.name, after[f.name])
        return made

    return tree_map(leaf, tree, is_leaf=dataclasses.is_dataclass)
