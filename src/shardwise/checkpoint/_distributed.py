"""``sw.checkpoint.load_distributed``: load any distributed checkpoint into a network as it is now.

The checkpoint's cut and the network's need not agree: each entry is assembled for what the
network holds on this rank (`SourceSet.assemble`), one entry at a time:

- a network not cut yet (before its first step, or data parallel): the whole tensors; the
  first step then cuts them (and optimizer state loaded here) as it cuts a fresh network;
- a planned network: this rank's blocks under its plan (every rank's, in a simulated world).

Every block it will read is checksummed first, so a corrupt file is refused before the network
or the optimizer changes.

- `load_distributed`: the public function (weights, and the optimizer state with
  ``optimizer=``).
- `_Entries`: the checkpoint's entries as a lazy mapping, so `load_param_into_net` matches
  names as usual and only one assembled tensor is alive at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._describe import network_strategy
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._load import load_param_into_net
from shardwise.checkpoint._optimizer import OptimizerState, load_optimizer_state
from shardwise.checkpoint._pieces import whole
from shardwise.checkpoint._sources import SourceSet


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
    source: SourceSet, network: nn.Module, shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """The first parameter or buffer whose name or global shape differs: `CheckpointError`."""
    model = source.model_names
    recorded = source.recorded_strategy
    wrapper = recorded.prefix if recorded is not None else ""
    for name, shape in shapes.items():
        if name not in model and wrapper and wrapper + name in model:
            raise CheckpointError(
                f"the checkpoint holds {name!r} as {wrapper + name!r}: it was saved through the "
                f"network's wrapper; load it into the wrapper (load_distributed(parallel_net, "
                "...), built before the first step) or merge it (sw.checkpoint.merge drops the "
                "prefix)"
            )
        if name not in model:
            raise CheckpointError(
                f"{type(network).__name__}.{name} {list(shape)} is not in the checkpoint "
                f"(which holds {model[:3]}...): a checkpoint of another network?"
            )
        if source.shape(name) != shape:
            raise CheckpointError(
                f"{name!r} is {list(source.shape(name))} in the checkpoint but {list(shape)} in "
                f"{type(network).__name__}: a checkpoint of another network?"
            )
    extra = [k for k in model if k not in shapes]
    if extra:
        raise CheckpointError(f"checkpoint entry {extra[0]!r} is not in {type(network).__name__}")


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
            shape, and nothing else (the first difference is named); False: load what matches.

    Returns:
        ``(param_not_load, ckpt_not_load)`` as `load_param_into_net` returns them.

    Example:
        >>> net, opt = build()                                        # doctest: +SKIP
        >>> sw.checkpoint.load_distributed(net, "ckpt_8_ranks", opt)  # on 2 ranks now
        ([], [])
    """
    source = SourceSet(Path(src_dir), name, prefix, src_strategy)
    strategy = network_strategy(network)
    shapes = {k: tuple(t.shape) for k, t in network.state_dict(keep_vars=True).items()}
    if strategy is not None:
        shapes |= {k: tuple(p.shape) for k, p in strategy.params.items() if k in shapes}
    if strict:
        _check_same_network(source, network, shapes)

    def make(key: str) -> torch.Tensor:
        shape = source.shape(key)
        if strategy is None:
            with comm.plain_tensors():  # (the same whole tensor on every rank)
                value = source.assemble(key, whole(shape))
            return comm.every_rank(value, copies=True)  # (their states are updated apart)
        return comm.rank_value(lambda r: source.assemble(key, strategy.entry_piece(key, shape, r)))

    model = source.model_names
    with comm.plain_tensors():  # (before loading anything; one read for the whole job)
        source.verify(source.names if optimizer is not None else model)
    result = load_param_into_net(network, _Entries(model, make), strict_load=strict)
    if optimizer is not None:
        _load_optimizer(source, optimizer, network, make)
    return result


def _load_optimizer(
    source: SourceSet,
    optimizer: torch.optim.Optimizer,
    network: nn.Module,
    make: Callable[[str], torch.Tensor],
) -> None:
    where = source.files[0].index.path
    description = fmt.parse_json(where, source.metadata, fmt.KEY_OPTIMIZER)
    if description is None:
        raise CheckpointError(f"{where}: holds no optimizer state (save it with optimizer=)")
    keys = [k for k in source.names if source.is_optimizer(k)]
    state = OptimizerState(json.loads(json.dumps(description)), {k: make(k) for k in keys})
    load_optimizer_state(optimizer, SimpleNamespace(path=where, optimizer_state=state), network)
