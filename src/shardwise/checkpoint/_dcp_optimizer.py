"""Optimizer state between shardwise's description and torch DCP's keys.

torch's ``get_optimizer_state_dict`` keys an optimizer's state by parameter FQN, as shardwise
does: ``{"state": {fqn: {"exp_avg": ..., "step": ...}}, "param_groups": [{..., "params":
[fqn, ...]}]}``. DCP flattens that under a top-level key (``optimizer``): tensors become
``optimizer.state.<fqn>.<key>``, the rest ``optimizer.param_groups.<i>.<key>`` values (saved
with ``torch.save``). With ``flatten_optimizer_state_dict=True`` (torchtitan) the groups are
instead one entry per parameter and hyperparameter, ``optimizer.param_groups.<fqn>.<key>``.

- `Ref`: a tensor of the shardwise checkpoint, named by its entry key (written as a DCP tensor).
- `torch_leaves`: shardwise's optimizer description as DCP's flattened (path, value) leaves,
  either layout (`_flat_layout` for torchtitan's).
- `leaves`: a nested state dict's leaves, by DCP's traversal rules.
- `description_from_dcp`: a DCP checkpoint's optimizer keys back into shardwise's
  description (`_groups_nested`, `_groups_flat`) and the entry name of each tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._format import OPTIMIZER_PREFIX, decode_value, encode_value, tensor_ref

KeyPath = tuple[str | int, ...]
_GROUP = re.compile(r"^(\d+)\.([^.]+)$")


@dataclass(frozen=True)
class Ref:
    """A tensor of the shardwise checkpoint: entry `key`."""

    key: str


def _terminal(values: list[Any]) -> bool:
    """DCP's rule: a list is one leaf unless it holds a mapping, a tensor or such a list."""
    for v in values:
        if isinstance(v, Mapping | Ref) or (isinstance(v, list) and not _terminal(v)):
            return False
    return True


def leaves(value: Any, path: KeyPath, out: list[tuple[KeyPath, Any]]) -> list[tuple[KeyPath, Any]]:
    """Append the (path, leaf) pairs DCP's flattening makes of `value` at `path` to `out`."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            leaves(v, (*path, str(k)), out)
    elif isinstance(value, list) and not _terminal(value):
        for i, v in enumerate(value):
            leaves(v, (*path, i), out)
    else:
        out.append((path, value))
    return out


def _flat_layout(state: Mapping[str, Any], groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """torch's ``flatten_optimizer_state_dict=True`` layout of a nested optimizer state dict."""
    out: dict[str, Any] = {}
    for path, value in leaves(state, ("state",), []):
        out[".".join(map(str, path))] = value
    for group in groups:
        for fqn in group["params"]:
            for k, v in group.items():
                if k != "params":
                    out[f"param_groups.{fqn}.{k}"] = v
    return out


def torch_leaves(
    description: Mapping[str, Any], key: str, flatten: bool
) -> list[tuple[KeyPath, Any]]:
    """shardwise's optimizer description as DCP's leaves under top-level `key`.

    Args:
        description: the ``shardwise.optimizer`` JSON.
        key: the top-level key (``optimizer``).
        flatten: torchtitan's layout (``flatten_optimizer_state_dict=True``).

    Returns:
        (path, value) pairs; a tensor is a `Ref` to its checkpoint entry.
    """
    refs = {k: Ref(k) for k in description.get("tensors", [])}
    state = decode_value(description["state"], refs)
    groups = decode_value(description["param_groups"], refs)
    nested = _flat_layout(state, groups) if flatten else {"state": state, "param_groups": groups}
    return leaves(nested, (key,), [])


def _owner(rest: str, fqns: Sequence[str]) -> tuple[str, list[str]]:
    """Split ``<fqn>.<key>[.<sub>...]`` into the longest known fqn and the key path."""
    known = [f for f in fqns if rest.startswith(f + ".")]
    if known:
        fqn = max(known, key=len)
        return fqn, rest[len(fqn) + 1 :].split(".")
    fqn, _, k = rest.rpartition(".")
    return fqn, [k]


def _put(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _plain(value: Any, where: str) -> Any:
    """A non-tensor DCP value as shardwise's JSON (tensors inside are not supported)."""
    found: dict[str, Any] = {}
    try:
        out = encode_value(value, where, found)
    except TypeError as e:
        raise CheckpointError(f"DCP optimizer value {where!r} cannot be stored: {e}") from None
    if found:
        raise CheckpointError(f"DCP optimizer value {where!r} holds tensors inside a {value!r}")
    return out


def description_from_dcp(
    keys: Mapping[str, bool],
    read: Callable[[list[str]], dict[str, Any]],
    prefix: str,
    fqns: Sequence[str],
    class_name: str,
) -> tuple[dict[str, Any], dict[str, str]]:
    """shardwise's optimizer description from a DCP checkpoint's optimizer keys.

    Args:
        keys: each DCP key under `prefix` -> whether it is a tensor.
        read: reads the non-tensor values of the given keys.
        prefix: the optimizer's top-level key plus a dot (``optimizer.``).
        fqns: the model's entry names, to split ``<fqn>.<key>`` (fqns hold dots).
        class_name: the optimizer class (``Adam``); DCP does not record it.

    Returns:
        ``(description, tensors)``: the ``shardwise.optimizer`` JSON, and each shardwise
        optimizer entry name -> its DCP key.
    """
    values = read([k for k, is_tensor in keys.items() if not is_tensor])
    state: dict[str, Any] = {}
    tensors: dict[str, str] = {}
    for key, is_tensor in keys.items():
        rest = key[len(prefix) :]
        if not rest.startswith("state."):
            continue
        fqn, path = _owner(rest[len("state.") :], fqns)
        name = f"{OPTIMIZER_PREFIX}state.{fqn}.{'.'.join(path)}"
        if is_tensor:
            tensors[name] = key
            _put(state.setdefault(fqn, {}), path, tensor_ref(name))
        else:
            _put(state.setdefault(fqn, {}), path, _plain(values[key], key))
    group_keys = {k[len(prefix) + len("param_groups.") :]: k for k in keys
                  if k.startswith(f"{prefix}param_groups.")}  # fmt: skip
    nested = any(_GROUP.match(r) and r.endswith(".params") for r in group_keys)
    make = _groups_nested if nested else _groups_flat
    groups = make(group_keys, keys, values, fqns, tensors)
    description = {
        "class": class_name,
        "param_groups": groups,
        "state": state,
        "tensors": sorted(tensors),
    }
    return description, tensors


def _groups_nested(
    group_keys: Mapping[str, str],
    keys: Mapping[str, bool],
    values: Mapping[str, Any],
    fqns: Sequence[str],
    tensors: dict[str, str],
) -> list[dict[str, Any]]:
    groups: dict[int, dict[str, Any]] = {}
    for rest, key in group_keys.items():
        m = _GROUP.match(rest)
        if m is None:
            raise CheckpointError(f"DCP key {key!r} is not a param group entry")
        number, k = int(m.group(1)), m.group(2)
        if keys[key]:
            name = f"{OPTIMIZER_PREFIX}param_groups.{number}.{k}"
            tensors[name] = key
            groups.setdefault(number, {})[k] = tensor_ref(name)
        else:
            groups.setdefault(number, {})[k] = _plain(values[key], key)
    if sorted(groups) != list(range(len(groups))):
        raise CheckpointError(f"DCP param groups {sorted(groups)} are not numbered 0..n-1")
    return [groups[i] for i in range(len(groups))]


def _groups_flat(
    group_keys: Mapping[str, str],
    keys: Mapping[str, bool],
    values: Mapping[str, Any],
    fqns: Sequence[str],
    tensors: dict[str, str],
) -> list[dict[str, Any]]:
    """torchtitan's per-parameter groups: parameters with equal hyperparameters form one
    group, in the order of the model's DCP keys (`load_optimizer_state` matches groups by
    their parameters)."""
    per_param: dict[str, dict[str, Any]] = {}
    for rest, key in group_keys.items():
        fqn, path = _owner(rest, fqns)
        if keys[key] or len(path) != 1:
            raise CheckpointError(f"DCP key {key!r}: a tensor or nested hyperparameter")
        per_param.setdefault(fqn, {})[path[0]] = _plain(values[key], key)
    order = [f for f in fqns if f in per_param] + [f for f in per_param if f not in fqns]
    groups: dict[str, dict[str, Any]] = {}
    for fqn in order:
        hyper = per_param[fqn]
        group = groups.setdefault(json.dumps(hyper, sort_keys=True), {**hyper, "params": []})
        group["params"].append(fqn)
    return list(groups.values())
