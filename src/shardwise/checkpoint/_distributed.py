"""``sw.checkpoint.load_distributed``: load any distributed checkpoint into a network as it is now.

The checkpoint's cut and the network's need not agree: each entry is assembled for what the
network holds on this rank (`SourceSet.assemble`), one entry at a time:

- a network not cut yet (before its first step, or data parallel): the whole tensors; the
  first step then cuts them (and optimizer state loaded here) as it cuts a fresh network;
- a planned network: this rank's blocks under its plan (every rank's, in a simulated world).

Every block it will read is checksummed first, and the optimizer state checked against the
optimizer (class, parameter groups), so a corrupt file or a refused optimizer state is refused
before the network or the optimizer changes.

- `load_distributed`: the public function (weights, and the optimizer state with
  ``optimizer=``).
- `_Entries`: the checkpoint's entries as a lazy mapping, so `load_param_into_net` matches
  names as usual and only one assembled tensor is alive at a time.

A checkpoint saved through an `AutoParallel` wrapper (``network.`` names) loaded into the bare
network, or the reverse, is read under the network's names (its optimizer state too:
`_renames`), as `transform` and `load_param_into_net` match.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._describe import network_strategy
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._load import load_entries
from shardwise.checkpoint._optimizer import (
    OptimizerState,
    checked_groups,
    load_optimizer_state,
    param_names,
)
from shardwise.checkpoint._pieces import whole
from shardwise.checkpoint._renames import renamed, renamed_description, wrapper_renames
from shardwise.checkpoint._sources import SourceSet
from shardwise.checkpoint._state_shapes import (
    expected_shape,
    flat_state_sizes,
    state_fits,
    state_shape_error,
)
from shardwise.checkpoint._strategy import owner_of


class _Entries(Mapping[str, torch.Tensor]):
    """Entries `keys` of a checkpoint, each made by `make(key)` when asked."""

    def __init__(self, keys: Sequence[str], make: Callable[[str], torch.Tensor]) -> None:
        self.keys_, self.make = list(keys), make

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.keys_:
            raise KeyError(key)
        return self.make(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


def _check_same_network(
    source: SourceSet,
    network: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    keys: Mapping[str, str],
    dtypes: Mapping[str, torch.dtype],
) -> None:
    """The first parameter or buffer whose name, global shape or dtype differs:
    `CheckpointError` (`keys`: each network name of a model entry -> its checkpoint key). A
    tied tensor the checkpoint holds under one of its names is there (a Hugging Face GPT-2 file
    holds the embedding, not the head tied to it), as for `load_param_into_net`."""
    model = list(keys)
    recorded = source.recorded_strategy
    wrapper = recorded.prefix if recorded is not None else ""
    tensor_of = {n: id(t) for n, t in network.state_dict(keep_vars=True).items()}
    held = {tensor_of.get(n) for n in keys}
    for name, shape in shapes.items():
        if name not in keys and name in tensor_of and tensor_of[name] in held:
            continue  # (another name of this tied tensor is in the checkpoint, checked there)
        if name not in keys and wrapper and wrapper + name in keys:
            raise CheckpointError(
                f"the checkpoint holds {name!r} as {wrapper + name!r}: it was saved through the "
                f"network's wrapper; load it into the wrapper (load_distributed(parallel_net, "
                "...), built before the first step) or merge it (sw.checkpoint.merge drops the "
                "prefix)"
            )
        if name not in keys:
            raise CheckpointError(
                f"{type(network).__name__}.{name} {list(shape)} is not in the checkpoint "
                f"(which holds {model[:3]}...): a checkpoint of another network?"
            )
        if source.shape(keys[name]) != shape:
            raise CheckpointError(
                f"{keys[name]!r} is {list(source.shape(keys[name]))} in the checkpoint but "
                f"{list(shape)} in {type(network).__name__}: a checkpoint of another network?"
            )
        if source.dtype(keys[name]) != dtypes[name]:
            raise CheckpointError(
                f"cannot load {name!r}: checkpoint dtype {source.dtype(keys[name])} != network "
                f"dtype {dtypes[name]} (strict=True does not convert; strict=False casts to the "
                "network's dtype)"
            )
    extra = [keys[k] for k in model if k not in shapes]
    if extra:
        raise CheckpointError(
            f"checkpoint entry {extra[0]!r} is not in {type(network).__name__} (which holds "
            f"{list(shapes)[:3]}...): a checkpoint of another network? strict=False loads the "
            "rest"
        )


def _check_shared_shapes(
    source: SourceSet, shapes: Mapping[str, tuple[int, ...]], keys: Mapping[str, str]
) -> None:
    """``strict=False``: the first entry the network and the checkpoint both hold with other
    global shapes: `CheckpointError` (as loading it would raise, but before any copy)."""
    for name, key in keys.items():
        if source.shape(key) != shapes[name]:
            raise CheckpointError(
                f"cannot load {name!r}: checkpoint shape {list(source.shape(key))} != network "
                f"shape {list(shapes[name])} (strict=False leaves out missing and extra "
                "entries, not ones of another shape); nothing was loaded"
            )


def load_distributed(
    network: nn.Module,
    src_dir: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    name: str | None = None,
    prefix: str | None = None,
    src_strategy: object = None,
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Load a distributed checkpoint of any plan or device count into `network` (and
    `optimizer`), cut for the network's current plan on this rank.

    Call it before the first step, as with a plain checkpoint: the network then receives the
    whole tensors and its first step cuts them for its plan. On a network already planned it
    loads this rank's blocks directly.

    Args:
        network: the network (plain, or wrapped by `AutoParallel`).
        src_dir: the checkpoint (``rank_<r>/`` folders, or the file(s) of one rank).
        optimizer: also restore this optimizer's state (saved with ``optimizer=``).
        name, prefix: which file of each rank folder (default: the only one).
        src_strategy: how the source was cut, for files that do not record it.
        strict: every parameter and buffer must be in the checkpoint with the same global
            shape and dtype, and nothing else (the first difference is named; names may differ
            by a wrapper's ``network.`` prefix on all of them); False: load what matches, cast
            to the network's dtypes.

    Returns:
        ``(param_not_load, ckpt_not_load)`` as `load_param_into_net` returns them.

    Example:
        >>> net, opt = build()                                        # doctest: +SKIP
        >>> sw.checkpoint.load_distributed(net, "ckpt_8_ranks", opt)  # on 2 ranks now
        ([], [])
    """
    source = SourceSet(Path(src_dir), name, prefix, src_strategy)
    strategy = network_strategy(network)
    entries = network.state_dict(keep_vars=True)
    shapes = {k: tuple(t.shape) for k, t in entries.items()}
    if strategy is not None:
        shapes |= {k: tuple(p.shape) for k, p in strategy.params.items() if k in shapes}
    renames = wrapper_renames(shapes, source.model_names)
    keys = {renamed(k, renames): k for k in source.names}  # (network name -> checkpoint key)
    model = [renamed(k, renames) for k in source.model_names]
    if strict:
        dtypes = {k: t.dtype for k, t in entries.items()}
        _check_same_network(source, network, shapes, {n: keys[n] for n in model}, dtypes)
    else:  # (the entries both hold must agree: refused before anything is copied)
        _check_shared_shapes(source, shapes, {n: keys[n] for n in model if n in shapes})

    def make(name: str) -> torch.Tensor:  # (`name`: the entry under the network's names)
        key = keys[name]
        shape = source.shape(key)
        if strategy is None:
            with comm.plain_tensors():  # (the same whole tensor on every rank)
                value = source.assemble(key, whole(shape))
            return comm.every_rank(value, copies=True)  # (their states are updated apart)
        return comm.rank_value(lambda r: source.assemble(key, strategy.entry_piece(name, shape, r)))

    described = None
    if optimizer is not None:  # (refused before the network changes, as a corrupt file is)
        described = _described(source, renames)
        checked_groups(optimizer, described, str(source.files[0].index.path), network)
        flat = flat_state_sizes(optimizer, param_names(optimizer, network), shapes)
        _check_state_shapes(source, renames, shapes, flat)
    with comm.plain_tensors():  # (before loading anything; one read for the whole job)
        source.verify(source.names if optimizer is not None else source.model_names)
    lazy = _Entries(model, make)  # (checked above: each assembled once, when copied)
    result = load_entries(network, lazy, strict, option="strict", prechecked=True)
    if optimizer is not None and described is not None:
        _load_optimizer(source, optimizer, network, lambda k: make(renamed(k, renames)), described)
    return result


def _check_state_shapes(
    source: SourceSet,
    renames: Mapping[str, str],
    shapes: Mapping[str, tuple[int, ...]],
    flat: Mapping[str, int],
) -> None:
    """`CheckpointError` for the first optimizer state entry whose global shape does not fit
    its parameter's in the network (`shapes`: global shapes by network name; `flat`: the
    parameters holding state flattened over their group, `flat_state_sizes`)."""
    for key in source.names:
        if not source.is_optimizer(key):
            continue
        owner = owner_of(key)
        name = renames.get(owner, owner)
        if name not in shapes:
            continue
        param, what = expected_shape(source.shape(key), shapes[name], flat.get(name))
        if not state_fits(source.shape(key), param):
            where = str(source.files[0].index.path)
            raise state_shape_error(where, name, key, source.shape(key), param, what=what)


def _described(source: SourceSet, renames: Mapping[str, str]) -> dict[str, Any]:
    """The checkpoint's optimizer description under the network's parameter names (`renames`:
    the checkpoint's -> the network's, where a wrapper's prefix differs)."""
    where = source.files[0].index.path
    description = fmt.parse_json(where, source.metadata, fmt.KEY_OPTIMIZER)
    if description is None:
        raise CheckpointError(f"{where}: holds no optimizer state (save it with optimizer=)")
    return renamed_description(description, renames)


def _load_optimizer(
    source: SourceSet,
    optimizer: torch.optim.Optimizer,
    network: nn.Module,
    make: Callable[[str], torch.Tensor],
    described: dict[str, Any],
) -> None:
    """Restore `optimizer` (`make`: a checkpoint entry's tensor for the network; `described`:
    `_described`'s description, already checked against the optimizer)."""
    where = source.files[0].index.path
    keys = [k for k in source.names if source.is_optimizer(k)]
    state = OptimizerState(described, {k: make(k) for k in keys})
    load_optimizer_state(optimizer, SimpleNamespace(path=where, optimizer_state=state), network)
