"""torch's pytree: flattening nested containers of tensors (``torch.utils._pytree``).

shardwise flattens a call's arguments and results the way torch does (capture, the plan
executor, DTensor's argument specs), so that a user's containers (namedtuples, dataclasses
registered with torch, ``torch.Size``) flatten alike everywhere; torch has no public pytree
module. The functions are torch's own objects (``pytree.tree_leaves`` costs what it did).
"""

from __future__ import annotations

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
    "tree_map_only",
    "tree_structure",
    "tree_unflatten",
]
