"""Names that differ by a wrapper's prefix on every name: a checkpoint read under the network's.

A checkpoint saved through a wrapper (`AutoParallel`'s ``network.``, `torch.compile`'s
``_orig_mod.``) and loaded into the bare network, or the reverse, holds the same network: its
entries and its optimizer description are read under the network's names.

- `wrapper_renames`: checkpoint name -> network name, where every name differs by one prefix.
- `renamed`: a model or optimizer entry's key under the network's names.
- `renamed_description`: an optimizer description (`optimizer_entries`) under them.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from shardwise.checkpoint._strategy import STATE_PREFIX, owner_of, wrapper_prefix


def wrapper_renames(names: Collection[str], model: Sequence[str]) -> dict[str, str]:
    """Checkpoint key -> network name where the two differ by one wrapper's prefix on every
    name (`names`: the network's; `model`: the checkpoint's model entries); empty when the names
    agree, or differ otherwise.

    Example:
        >>> wrapper_renames(["0.weight"], ["network.0.weight"])
        {'network.0.weight': '0.weight'}
    """
    held = set(model)
    if not names or all(n in held for n in names):
        return {}
    wrapper = wrapper_prefix(names, held)
    if wrapper is not None:
        return {wrapper + n: n for n in names}
    first = next(iter(names))
    for key in model:
        if first.endswith("." + key):
            wrapper = first[: -len(key)]
            if all(n.startswith(wrapper) and n[len(wrapper) :] in held for n in names):
                return {n[len(wrapper) :]: n for n in names}
    return {}


def renamed(key: str, renames: Mapping[str, str]) -> str:
    """Entry `key` (a model entry, or an optimizer entry ``optimizer.state.<param>.<key>``)
    with its parameter's name renamed by `renames`."""
    if not key.startswith(STATE_PREFIX):
        return renames.get(key, key)
    owner = owner_of(key)
    return STATE_PREFIX + renames.get(owner, owner) + key[len(STATE_PREFIX) + len(owner) :]


def renamed_description(
    description: Mapping[str, Any], renames: Mapping[str, str]
) -> dict[str, Any]:
    """A copy of an optimizer `description` with its parameter names (state, groups, aliases)
    renamed by `renames`; the tensor keys it refers to are the checkpoint's, unchanged."""
    described: dict[str, Any] = json.loads(json.dumps(description))
    described["state"] = {renames.get(n, n): v for n, v in described["state"].items()}
    for group in described["param_groups"]:
        group["params"] = [renames.get(n, n) for n in group["params"]]
    aliases = described.get("aliases") or {}
    if aliases:
        described["aliases"] = {renames.get(a, a): renames.get(n, n) for a, n in aliases.items()}
    return described
