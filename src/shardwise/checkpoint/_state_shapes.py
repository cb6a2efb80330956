"""Optimizer state that does not fit its parameters, refused before anything is loaded.

- `state_fits`: whether state of one shape can belong to a parameter of another (a factored
  optimizer's row / column statistics, a scalar step).
- `flat_state_sizes`: the parameters whose state holds vectors flattened over their whole
  parameter group (``torch.optim.LBFGS``'s search direction and last gradient) -> that size;
  `expected_shape`: the shape a state tensor is checked against (the parameter's, or that size).
- `state_shape_error`: the refusal naming the entry, both shapes and the fix.
- `check_state_shapes`: the first state tensor of a loaded optimizer state dict that does not
  fit, with the fix for one rank's file of a distributed checkpoint
  (`_pieces.rank_file_hint`).
"""

from __future__ import annotations

import math
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


def flat_state_sizes(
    optimizer: torch.optim.Optimizer, names: Sequence[str], shapes: Mapping[str, Sequence[int]]
) -> dict[str, int]:
    """The name of each parameter whose state holds vectors flattened over its whole group ->
    their size, the group's total number of elements (`names`: the optimizer's parameters in
    order; `shapes`: their shapes by name). ``torch.optim.LBFGS`` keeps its search direction,
    last gradient and history that way in the first parameter's state; other optimizers keep
    state per parameter (none)."""
    if not isinstance(optimizer, torch.optim.LBFGS):
        return {}
    sizes, position = {}, 0
    for group in optimizer.param_groups:
        members = names[position : position + len(group["params"])]
        position += len(group["params"])
        if members and all(n in shapes for n in members):
            sizes[members[0]] = sum(math.prod(shapes[n]) for n in members)
    return sizes


def expected_shape(
    state: Sequence[int], param: Sequence[int], flat: int | None
) -> tuple[tuple[int, ...], str]:
    """The shape state of shape `state` is checked against, and what that shape is: a vector's
    is the flattened group's `(flat,)` where the parameter holds such state (`flat_state_sizes`),
    otherwise the parameter's."""
    if flat is not None and len(state) == 1:
        return (flat,), "flattened parameter group size"
    return tuple(param), "parameter shape"


def state_shape_error(
    where: str,
    name: str,
    key: str,
    state: Sequence[int],
    param: Sequence[int],
    hint: str = "",
    what: str = "parameter shape",
) -> CheckpointError:
    """The refusal of optimizer state `key` of parameter `name` whose shape `state` does not
    fit the parameter's `param` (`hint`: the fix; by default another network's checkpoint;
    `what`: what `param` is, `expected_shape`)."""
    hint = hint or (
        "; a checkpoint of another network (or of this one in another size)? build the network "
        "and the optimizer as the saving job did"
    )
    return CheckpointError(
        f"{where}: cannot load optimizer state {key!r} of {name!r}: checkpoint shape "
        f"{list(state)} != {what} {list(param)}{hint}; nothing was loaded"
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
    ordered = [names.get(i, str(i)) for i in range(len(params))]
    shapes = {n: p.shape for n, p in zip(ordered, params, strict=True)}
    flat = flat_state_sizes(optimizer, ordered, shapes)
    for index, entries in state.items():
        if not isinstance(entries, Mapping):
            continue
        for item, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue
            shape = tuple(value.shape)
            param, what = expected_shape(shape, params[index].shape, flat.get(names[index]))
            key = key_of.get(id(value), f"{OPTIMIZER_PREFIX}state.{names[index]}.{item}")
            recorded = pieces.get(key)
            if state_fits(shape, param) and (recorded is None or shape == param or not shape):
                continue
            hint = rank_file_hint(recorded, where, ", optimizer")
            raise state_shape_error(where, names[index], key, shape, param, hint, what)
