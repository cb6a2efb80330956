"""Optimizer state that does not fit its parameters, refused before anything is loaded.

- `state_fits`: whether state of one shape can belong to a parameter of another (a factored
  optimizer's row / column statistics, a scalar step).
- `state_shape_error`: the refusal naming the entry, both shapes and the fix.
- `check_state_shapes`: the first state tensor of a loaded optimizer state dict that does not
  fit, with the fix for one rank's file of a distributed checkpoint
  (`_pieces.rank_file_hint`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._format import OPTIMIZER_PREFIX
from shardwise.checkpoint._pieces import rank_file_hint


def state_fits(state: Sequence[int], param: Sequence[int]) -> bool:
    """Whether optimizer state of shape `state` can belong to a parameter of shape `param`:
    state of as many dims must have the parameter's sizes (or 1 where a factored optimizer
    keeps one size, as Adafactor's row / column statistics); other state (a scalar step, a
    flattened factor) is not compared."""
    if len(state) != len(param) or not state:
        return True
    return all(s == p or s == 1 for s, p in zip(state, param, strict=True))


def state_shape_error(
    where: str, name: str, key: str, state: Sequence[int], param: Sequence[int], hint: str = ""
) -> CheckpointError:
    """The refusal of optimizer state `key` of parameter `name` whose shape `state` does not
    fit the parameter's `param` (`hint`: the fix; by default another network's checkpoint)."""
    hint = hint or (
        "; a checkpoint of another network (or of this one in another size)? build the network "
        "and the optimizer as the saving job did"
    )
    return CheckpointError(
        f"{where}: cannot load optimizer state {key!r} of {name!r}: checkpoint shape "
        f"{list(state)} != parameter shape {list(param)}{hint}; nothing was loaded"
    )


def check_state_shapes(
    optimizer: torch.optim.Optimizer,
    state: Mapping[int, Any],
    names: Mapping[int, str],
    key_of: Mapping[int, str],
    pieces: Mapping[str, Any],
    where: str,
) -> None:
    """`CheckpointError` for the first state tensor that does not fit its parameter (`key_of`:
    each checkpoint tensor's id -> its entry; `pieces`: the rank file's recorded blocks)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, entries in state.items():
        param = tuple(params[index].shape)
        if not isinstance(entries, Mapping):
            continue
        for item, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue
            shape = tuple(value.shape)
            key = key_of.get(id(value), f"{OPTIMIZER_PREFIX}state.{names[index]}.{item}")
            recorded = pieces.get(key)
            if state_fits(shape, param) and (recorded is None or shape == param or not shape):
                continue
            hint = rank_file_hint(recorded, where, ", optimizer")
            raise state_shape_error(where, names[index], key, shape, param, hint)
