"""Optimizer state in a checkpoint, keyed by parameter *names* instead of positions.

Any ``torch.optim`` optimizer works: its ``state_dict()`` is split into tensors (stored as
safetensors entries ``optimizer.state.<param name>.<key>``) and everything else (param
groups with their hyperparameters and parameter names, non-tensor state such as ints)
stored as JSON. Loading maps the names back onto the new optimizer's parameters and calls
``optimizer.load_state_dict`` (with copies of the checkpoint's tensors, so training leaves the
loaded checkpoint as it was), so a resumed run continues bit-identically.

- `param_names`: the name of each optimizer parameter (module path, dict key, or index).
- `optimizer_entries`: state_dict -> (tensors, JSON description) for saving.
- `OptimizerState`: what `load_checkpoint` found (the JSON and its tensors).
- `merged_description`: one description for the rank files of a job whose ranks each hold the
  state of some parameters (data_parallel with hsdp: each parameter's on its owner rank).
- `load_optimizer_state`: restore an optimizer from a loaded checkpoint (state that does not
  fit its parameters refused first: `_state_shapes`; names under a wrapper's prefix matched:
  `_renames`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardwise import communication as comm
from shardwise.checkpoint._describe import check_rank_pieces
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._format import KEY_PIECES, OPTIMIZER_PREFIX, decode_value, encode_value
from shardwise.checkpoint._renames import renamed, renamed_description, wrapper_renames
from shardwise.checkpoint._state_shapes import check_state_shapes
from shardwise.parameter import tied_names


@dataclass
class OptimizerState:
    """The optimizer part of a checkpoint: JSON description plus its tensors by key."""

    description: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def param_names(optimizer: torch.optim.Optimizer, owner: object = None) -> list[str]:
    """Names of the optimizer's parameters, in ``state_dict`` index order.

    Args:
        optimizer: any torch optimizer.
        owner: the ``nn.Module`` (names = module paths) or the dict name -> tensor that
            holds the parameters; parameters it does not hold are named by their index.

    Returns:
        One unique name per parameter.
    """
    by_id: dict[int, str] = {}
    if isinstance(owner, torch.nn.Module):
        for name, param in owner.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), name)
    elif isinstance(owner, Mapping):
        by_id = {id(value): str(key) for key, value in owner.items()}
    names = [by_id.get(id(p), str(i)) for i, p in enumerate(_flat_params(optimizer))]
    if len(set(names)) != len(names):
        raise CheckpointError(f"optimizer parameters have clashing names: {names}")
    return names


def optimizer_entries(
    optimizer: torch.optim.Optimizer, owner: object = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into safetensors entries and a JSON description.

    Args:
        optimizer: any torch optimizer.
        owner: as for `param_names`.

    Returns:
        ``(tensors, description)``; ``description["tensors"]`` lists the tensor keys.
    """
    names = param_names(optimizer, owner)
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    for index, entries in state_dict["state"].items():
        name = names[index]
        prefix = f"{OPTIMIZER_PREFIX}state.{name}"
        state[name] = {k: encode_value(v, f"{prefix}.{k}", tensors) for k, v in entries.items()}
    groups = []
    for number, group in enumerate(state_dict["param_groups"]):
        prefix = f"{OPTIMIZER_PREFIX}param_groups.{number}"
        encoded = {
            k: encode_value(v, f"{prefix}.{k}", tensors) for k, v in group.items() if k != "params"
        }
        encoded["params"] = [names[i] for i in group["params"]]
        groups.append(encoded)
    description = {
        "class": type(optimizer).__qualname__,
        "param_groups": groups,
        "state": state,
        "tensors": sorted(tensors),
    }
    aliases = _aliases(optimizer, owner, names)
    if aliases:  # (a loading job without the tie is told so)
        description["aliases"] = aliases
    return tensors, description


def _aliases(optimizer: torch.optim.Optimizer, owner: object, names: list[str]) -> dict[str, str]:
    """The other names of the optimizer's tied parameters in `owner` (a module) -> the name
    their state is saved under."""
    if not isinstance(owner, torch.nn.Module):
        return {}
    saved = {id(p): name for p, name in zip(_flat_params(optimizer), names, strict=True)}
    return {
        name: saved[id(param)]
        for name, param in owner.named_parameters(remove_duplicate=False)
        if id(param) in saved and saved[id(param)] != name
    }


def merged_description(
    found: Sequence[tuple[Path, dict[str, Any] | None]],
) -> dict[str, Any] | None:
    """One optimizer description for rank files that each describe the state they hold.

    Every file describes the same optimizer (class and parameter groups); each parameter's
    state is taken from the files that hold it (data_parallel with hsdp: its owner rank's file
    only), and the tensor keys are those of every file.

    Args:
        found: each rank file's path and its description (None: saved without optimizer).

    Returns:
        The description, state in parameter order; None when no file has one.

    Raises:
        CheckpointError: some files hold optimizer state and others none, or two files
            describe another optimizer or another state of one parameter.
    """
    described = [(path, d) for path, d in found if d is not None]
    if not described:
        return None
    first_path, first = described[0]
    if len(described) != len(found):
        bare = next(path for path, d in found if d is None)
        raise CheckpointError(
            f"{bare} holds no optimizer state but {first_path} does: the rank files are of "
            "different saves; put the files of one save together"
        )
    state: dict[str, tuple[Path, Any]] = {}
    for path, d in described:
        for key in ("class", "param_groups"):
            if d.get(key) != first.get(key):
                raise CheckpointError(
                    f"{path} describes another optimizer ({key}) than {first_path}: the rank "
                    "files are of different checkpoints; put the files of one save together"
                )
        for name, entries in d.get("state", {}).items():
            held = state.setdefault(name, (path, entries))
            if held[1] != entries:
                raise CheckpointError(
                    f"{path} and {held[0]} describe different optimizer state for {name!r}: "
                    "the rank files are of different checkpoints"
                )
    order = [n for g in first.get("param_groups", ()) for n in g.get("params", ()) if n in state]
    order += [n for n in state if n not in order]
    tensors = sorted({k for _, d in described for k in d.get("tensors", ())})
    return first | {"state": {n: state[n][1] for n in order}, "tensors": tensors}


def _few(names: Sequence[str], limit: int = 4) -> str:
    """`names` quoted, at most `limit` of them (a GPT-2's groups hold ~150 names)."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _is(names: Sequence[str]) -> str:
    return "is" if len(names) == 1 else "are"


def _by_position(kept: Collection[str], held: Collection[str]) -> bool:
    """Whether the saved groups name parameters by position where this optimizer's are named
    by the network (`save_checkpoint(net.state_dict(), optimizer=...)` loaded with net=)."""
    return (
        bool(kept)
        and all(n.isdigit() for n in kept)
        and not any(n in held for n in kept)
        and any(not n.isdigit() for n in held)
    )


def _group_difference(
    optimizer: torch.optim.Optimizer,
    saved: list[dict[str, Any]],
    names: list[str],
    aliases: Mapping[str, str],
    ties: Mapping[str, str],
) -> str:
    """Which parameters make the saved groups and the optimizer's differ, and the fix
    (`aliases`: the saving job's tied names; `ties`: this network's, `tied_names`)."""
    held: dict[str, int] = {}
    position = 0
    for number, group in enumerate(optimizer.param_groups):
        for name in names[position : position + len(group["params"])]:
            held.setdefault(name, number)
        position += len(group["params"])
    kept = {name: i for i, g in enumerate(saved) for name in g["params"]}
    if _by_position(kept, held):
        return (
            f"the checkpoint names the optimizer's parameters by position ({_few(list(kept))}): "
            "it was saved from a state_dict (copies, not the optimizer's parameters) instead of "
            "the network; load it with sw.checkpoint.load_optimizer_state(optimizer, ckpt) "
            "without net= (parameters matched by position), or save the network itself"
        )
    untied = [n for n in kept if n not in held and ties.get(n) in held]
    missing = [n for n in kept if n not in held and n not in untied]
    tied = [n for n in held if n not in kept and aliases.get(n) in kept]
    extra = [n for n in held if n not in kept and n not in tied]
    parts = []
    if tied:
        parts.append(
            f"{tied[0]!r} is in this optimizer's group {held[tied[0]]} but was tied to "
            f"{aliases[tied[0]]!r} when saved (one parameter, its state saved under that name): "
            "tie them as the saving job did"
        )
    if untied:
        parts.append(
            f"{untied[0]!r} was saved as a parameter of its own (its state and group apart) but "
            f"this network ties it to {ties[untied[0]]!r}: untie them as the saving job did"
        )
    if missing:
        parts.append(
            f"{_few(missing)} {_is(missing)} in a saved parameter group but in no group of this "
            "optimizer (frozen here?)"
        )
    if extra:
        parts.append(
            f"{_few(extra)} {_is(extra)} in this optimizer's group {held[extra[0]]} but in no "
            "saved group (frozen when saved?)"
        )
    if not parts:  # (the same parameters, grouped otherwise)
        for name, number in held.items():
            ours = [n for n, k in held.items() if k == number]
            theirs = saved[kept[name]]["params"]
            if set(ours) != set(theirs):
                parts.append(
                    f"{name!r} is in saved group {kept[name]} with {len(theirs)} parameters "
                    f"({_few(theirs)}) but in this optimizer's group {number} with {len(ours)} "
                    f"({_few(ours)})"
                )
                break
    if (tied or untied) and not (missing or extra):
        return "; ".join(parts)
    return "; ".join(parts) + ": set the same requires_grad / parameter groups as the saving job"


def _rebuilt_groups(
    optimizer: torch.optim.Optimizer,
    saved: list[dict[str, Any]],
    names: list[str],
    where: str,
    named: bool,
    aliases: Mapping[str, str],
    ties: Mapping[str, str],
) -> list[dict[str, Any]]:
    """The saved groups in the optimizer's order, each matched by the parameters it holds
    (a checkpoint whose groups came back in another order, as DCP's per-parameter groups do,
    loads as saved; an empty group of the optimizer that no saved group matches, one the
    per-parameter layout cannot record, keeps its own settings)."""
    hint = "" if named else " (pass the network as net= to match by name)"
    if sum(1 for g in saved if g["params"]) > len(optimizer.param_groups):
        raise CheckpointError(
            f"{where}: {len(saved)} parameter groups saved, the optimizer has "
            f"{len(optimizer.param_groups)}: "
            f"{_group_difference(optimizer, saved, names, aliases, ties)}{hint}"
        )
    index = {name: i for i, name in enumerate(names)}
    unused = list(saved)  # (each saved group taken once: two may hold the same, none)
    groups, position = [], 0
    for number, new in enumerate(optimizer.param_groups):
        current = names[position : position + len(new["params"])]
        position += len(new["params"])
        old = next((g for g in unused if set(g["params"]) == set(current)), None)
        if old is None and not current:  # (not recorded: its own settings)
            old = {k: v for k, v in new.items() if k != "params"} | {"params": []}
        elif old is None:
            raise CheckpointError(
                f"{where}: the optimizer's parameter group {number} matches no saved group: "
                f"{_group_difference(optimizer, saved, names, aliases, ties)}{hint}"
            )
        unused = [g for g in unused if g is not old]
        group = {k: v for k, v in old.items() if k != "params"}
        group["params"] = [index[name] for name in current]
        groups.append(group)
    return groups


def checked_groups(
    optimizer: torch.optim.Optimizer,
    description: Mapping[str, Any],
    where: str,
    net: torch.nn.Module | None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The optimizer's groups rebuilt from a saved `description`, and each parameter name's
    index; `CheckpointError` when the state cannot be loaded into `optimizer` (another class,
    other parameter groups, state of parameters it does not hold). Reads no tensor: a load
    calls it before it changes anything."""
    if description.get("class") != type(optimizer).__qualname__:
        raise CheckpointError(
            f"{where}: optimizer state of {description.get('class')} cannot be loaded into "
            f"{type(optimizer).__qualname__}: build the optimizer the saving job used"
        )
    names = param_names(optimizer, net)
    aliases = description.get("aliases") or {}
    ties = tied_names(net) if net is not None else {}
    groups = _rebuilt_groups(
        optimizer, description["param_groups"], names, where, net is not None, aliases, ties
    )
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(description["state"]) - set(index))
    if unknown:
        raise CheckpointError(
            f"{where}: optimizer state for {_few(unknown)}, which this optimizer does not hold"
        )
    return groups, index


def _prefix_renames(net: torch.nn.Module | None, ckpt: Any) -> dict[str, str]:
    """The checkpoint's parameter names -> `net`'s, where a wrapper's prefix (`AutoParallel`'s
    ``network.``, `torch.compile`'s ``_orig_mod.``) is on every name of one and not the other
    (matched on the model entries, as `load_distributed` matches them)."""
    if net is None or not isinstance(ckpt, Mapping) or not ckpt:
        return {}
    return wrapper_renames(list(net.state_dict(keep_vars=True)), list(ckpt))


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, ckpt: Any, net: torch.nn.Module | None = None
) -> None:
    """Restore ``optimizer`` from a checkpoint written with ``save_checkpoint(optimizer=...)``.

    Args:
        optimizer: a freshly built optimizer of the same class over the same parameters.
        ckpt: the `Checkpoint` returned by ``load_checkpoint``.
        net: the module whose parameter names the checkpoint used (needed when it was
            saved from a module; a wrapper's prefix on every name, saved through
            `AutoParallel` or `torch.compile` and loaded into the bare network or the reverse,
            is matched); without it parameters are matched by position.

    Returns:
        None.

    Example:
        >>> ckpt = load_checkpoint("run/checkpoint-1_100.safetensors")  # doctest: +SKIP
        >>> load_param_into_net(net, ckpt)  # doctest: +SKIP
        >>> load_optimizer_state(opt, ckpt, net)  # doctest: +SKIP
    """
    where = str(getattr(ckpt, "path", None) or "checkpoint")
    saved: OptimizerState | None = getattr(ckpt, "optimizer_state", None)
    if saved is None:
        raise CheckpointError(f"{where}: holds no optimizer state")
    renames = _prefix_renames(net, ckpt)
    description = renamed_description(saved.description, renames)
    groups, index = checked_groups(optimizer, description, where, net)
    metadata = getattr(ckpt, "metadata", None)
    if net is not None and isinstance(metadata, Mapping):
        keys = [(renamed(k, renames), k) for k in saved.tensors]
        check_rank_pieces(net, metadata, keys, where)
    state = {
        index[name]: decode_value(entries, saved.tensors)
        for name, entries in description["state"].items()
    }
    pieces = json.loads(metadata.get(KEY_PIECES, "{}")) if isinstance(metadata, Mapping) else {}
    key_of = {id(t): k for k, t in saved.tensors.items()}
    names = {i: name for name, i in index.items()}
    check_state_shapes(optimizer, state, names, key_of, pieces, where)  # (before any change)
    groups = [decode_value(group, saved.tensors) for group in groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    # torch keeps the given tensor where dtype and device already match: copy those, or
    # training would change the Checkpoint and two optimizers loaded from it share state.
    held = {id(t) for t in saved.tensors.values()}
    for entries in optimizer.state.values():  # (in a simulated world: each rank its own copy)
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                value = value.clone() if id(value) in held else value
                entries[key] = comm.every_rank(value, copies=True)
