"""``sw.load_param_into_net``: copy checkpoint entries into a network, MindSpore-style.

- `_net_entries`: what a network can receive: its parameters and persistent buffers, by
  ``state_dict`` name (tied parameters appear under each name).
- `_match`: exact names first; with ``strict_load=False`` also a unique suffix match at a
  ``.`` boundary (``network.fc.weight`` <-> ``fc.weight``), as MindSpore does for wrappers.
- `_check_entry`: shape check (a rank's part of a distributed checkpoint loaded into a whole
  tensor: the message says to use `load_distributed`), dtype check (strict) or cast
  (non-strict), for every entry before any copy, so a refused checkpoint loads nothing;
  `_copy` then copies in place (a deferred (meta) entry receives the values directly, so no
  random init ever runs).
- `load_param_into_net`: the public function; returns ``(param_not_load, ckpt_not_load)``. A
  rank file loaded into a planned network must hold this rank's blocks
  (`_describe.check_rank_pieces`). `load_entries` is its body, also used by
  `load_distributed` (whose strict argument the messages then name).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from shardwise._equal import same_values
from shardwise.checkpoint._describe import check_rank_pieces, network_strategy
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._format import KEY_PIECES
from shardwise.checkpoint._pieces import rank_file_hint
from shardwise.parameter import assign_tensor


def _net_entries(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(net.state_dict(keep_vars=True))


def _suffix_match(name: str, candidates: list[str]) -> str | None:
    found = [key for key in candidates if key.endswith("." + name) or name.endswith("." + key)]
    return found[0] if len(found) == 1 else None


def _match(
    names: list[str], keys: list[str], strict: bool, tensor_of: Mapping[str, int] | None = None
) -> dict[str, str]:
    """Network name -> checkpoint key: equal names, then (not `strict`) a unique dotted suffix
    both ways: a key several network tensors end with (``0.weight`` for ``a.0.weight`` and
    ``b.0.weight``) goes to none of them; the names of one tied tensor (`tensor_of`: name ->
    its tensor's id) count as one."""
    key_set = set(keys)
    matches = {name: name for name in names if name in key_set}
    if strict:
        return matches
    taken = set(matches.values())
    unused = [key for key in keys if key not in taken]
    proposed = {n: _suffix_match(n, unused) for n in names if n not in matches}
    ids = tensor_of or {}
    wanted: dict[str, set[object]] = {}
    for n, k in proposed.items():
        if k is not None:
            wanted.setdefault(k, set()).add(ids.get(n, n))
    matches |= {n: k for n, k in proposed.items() if k is not None and len(wanted[k]) == 1}
    return matches


def _is_planned(net: torch.nn.Module) -> bool:
    """Whether a plan stores (cut) some of `net`'s parameters."""
    try:
        return network_strategy(net) is not None
    except CheckpointError:  # (several planned networks inside)
        return True


def _block_hint(target: torch.Tensor, value: torch.Tensor, planned: bool) -> str:
    """Why a whole tensor cannot fill a smaller one of as many dims (the network holds this
    rank's block of it: planned by `AutoParallel`), and the fix; for a network no plan cut,
    the checkpoint is another network's."""
    have, whole = tuple(target.shape), tuple(value.shape)
    if not planned:
        return "; a checkpoint of another network (or of this one in another size)?"
    if len(have) != len(whole) or any(h > w for h, w in zip(have, whole, strict=True)):
        return ""
    return (
        "; the network holds this rank's block of it (AutoParallel cut it for its plan): load "
        "a whole checkpoint before the first call (the first step cuts it as it cuts a fresh "
        "network), or save it as a checkpoint folder and load that with "
        "sw.checkpoint.load_distributed(net, folder)"
    )


def _check_entry(
    name: str,
    target: torch.Tensor,
    value: object,
    key: str,
    strict: bool,
    hint: str = "",
    planned: bool = True,
    option: str = "strict_load",
) -> torch.Tensor:
    """`value` (checkpoint entry `key`) as the tensor to copy into `target`; `CheckpointError`
    for another shape or (`strict`) another dtype, TypeError for an entry that is no tensor:
    raised before anything is copied (`load_entries` checks every entry first)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"checkpoint entry {key!r} is not a tensor; nothing was loaded")
    if tuple(target.shape) != tuple(value.shape):
        hint = hint or _block_hint(target, value, planned)
        said = f"{list(target.shape)}{hint}"
        raise CheckpointError(
            f"cannot load {name!r}: checkpoint shape {list(value.shape)} != network shape "
            f"{said}{' ' if said.endswith('?') else '; '}nothing was loaded"
        )
    if strict and target.dtype != value.dtype:
        raise CheckpointError(
            f"cannot load {name!r}: checkpoint dtype {value.dtype} != network dtype "
            f"{target.dtype} ({option}=True does not convert; {option}=False casts to the "
            "network's dtype); nothing was loaded"
        )
    return value


def _copy(target: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        if target.is_meta:
            assign_tensor(target, value.to(dtype=target.dtype, copy=True))
        else:
            target.copy_(value)


def _check_tied(
    targets: Mapping[str, torch.Tensor],
    matches: Mapping[str, str],
    parameter_dict: Mapping[str, torch.Tensor],
    option: str,
) -> None:
    """Strict: the entries matched to the names of one tied tensor must hold one value
    (`CheckpointError` naming both, before anything is copied)."""
    first: dict[int, tuple[str, str, torch.Tensor]] = {}
    for name, key in matches.items():
        tid = id(targets[name])
        if tid not in first:
            value = parameter_dict[key]
            if isinstance(value, torch.Tensor):
                first[tid] = (name, key, value)
            continue
        name0, key0, value0 = first[tid]
        if key == key0:
            continue
        value = parameter_dict[key]
        if not isinstance(value, torch.Tensor):
            continue
        if not same_values(value.to(value0.dtype), value0):  # (a NaN equals a NaN)
            raise CheckpointError(
                f"checkpoint entries {key0!r} and {key!r} hold different values, but the network "
                f"ties {name0!r} and {name!r} (one tensor): the checkpoint was saved untied; "
                "untie them as the saving job did, or load with "
                f"{option}=False, which keeps {key0!r} (the tensor's first name); nothing was "
                "loaded"
            )


def load_param_into_net(
    net: torch.nn.Module,
    parameter_dict: Mapping[str, torch.Tensor] | None = None,
    strict_load: bool = False,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
) -> tuple[list[str], list[str]]:
    """Load checkpoint entries into ``net`` in place (MindSpore's ``load_param_into_net``).

    Args:
        net: the network; parameters and persistent buffers can be loaded. Deferred
            (``no_init_parameters``) entries are filled directly from the checkpoint.
        parameter_dict: name -> tensor, usually from ``load_checkpoint``.
        strict_load: ``True``: names must match exactly and dtypes must agree, and the
            entries of the names of one tied tensor must hold the same value. ``False``: names
            may also match by a unique dotted suffix, and values are cast to the network's
            dtype; a tied tensor receives the entry of its first name (in ``state_dict``
            order), the entries of its other names are not read.
        params: `parameter_dict` by the name ``load_param_into_net(net, params=...)`` uses
            (give one of the two: a TypeError otherwise).

    Returns:
        ``(param_not_load, ckpt_not_load)``: network entries that received nothing, and
        checkpoint entries that went nowhere.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> load_param_into_net(net, {"weight": torch.zeros(2, 4), "extra": torch.ones(1)})
        (['bias'], ['extra'])
    """
    if not isinstance(net, torch.nn.Module):
        raise TypeError(f"net must be an nn.Module, got {type(net).__name__}")
    if (parameter_dict is None) == (params is None):
        raise TypeError("load_param_into_net: pass the entries once, as parameter_dict= or params=")
    parameter_dict = parameter_dict if parameter_dict is not None else params
    if not isinstance(parameter_dict, Mapping):
        raise TypeError(f"parameter_dict must be a mapping, got {type(parameter_dict).__name__}")
    return load_entries(net, parameter_dict, strict_load)


def load_entries(
    net: torch.nn.Module,
    parameter_dict: Mapping[str, torch.Tensor],
    strict_load: bool,
    option: str = "strict_load",
    prechecked: bool = False,
) -> tuple[list[str], list[str]]:
    """`load_param_into_net` without its argument checks; `option` names the caller's strict
    argument in messages (``strict`` for `load_distributed`). Every entry's shape and dtype is
    checked before the first copy, unless the caller checked them (`prechecked`:
    `load_distributed`, whose entries are assembled one at a time when read)."""
    targets = _net_entries(net)
    tensor_of = {name: id(t) for name, t in targets.items()}
    matches = _match(list(targets), list(parameter_dict), strict_load, tensor_of)
    metadata = getattr(parameter_dict, "metadata", None) or {}
    pieces = json.loads(metadata.get(KEY_PIECES, "{}")) if isinstance(metadata, Mapping) else {}
    where = getattr(parameter_dict, "path", None)
    if isinstance(metadata, Mapping):
        check_rank_pieces(net, metadata, matches.items(), str(where or "checkpoint"))
    if strict_load:
        _check_tied(targets, matches, parameter_dict, option)
    planned = _is_planned(net)
    pending: dict[int, tuple[str, str]] = {}  # (a tied tensor: loaded once, under its first name)
    for name, key in matches.items():
        pending.setdefault(id(targets[name]), (name, key))

    def checked(name: str, key: str) -> torch.Tensor:
        hint = rank_file_hint(pieces.get(key), where, then=", before or after the first step")
        value = parameter_dict[key]
        return _check_entry(name, targets[name], value, key, strict_load, hint, planned, option)

    if not prechecked:  # (every entry checked before the first copy)
        for name, key in pending.values():
            checked(name, key)
    for name, key in pending.values():
        _copy(targets[name], checked(name, key) if prechecked else parameter_dict[key])
    used = set(matches.values())
    param_not_load = [name for name, target in targets.items() if id(target) not in pending]
    ckpt_not_load = [key for key in parameter_dict if key not in used]
    return param_not_load, ckpt_not_load
