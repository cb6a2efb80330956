"""Strategy files: a `ParallelPlan` kept as JSON and checked against the network on load.

- `save_operator_strategy_file` / `load_operator_strategy_file`: the whole plan (every op's
  strategy, every edge's steps, the parameters' layouts).
- `save_param_strategy_file` / `load_param_strategy_file`: the parameters' storage layouts only
  (what a checkpoint of the job needs to know: with optimizer parallel, ``shards`` says which
  parameters are cut further along dim 0, over which axes; ``aliases``: a tied parameter's other
  names), or those of some parameters (MindSpore's ``only_trainable_params``; ``left_out``
  names the others the plan cuts). Files are
  written atomically (`write_text_atomically`: a temporary name in the same folder, then
  renamed), so ranks writing the same path never leave half a file.
- `check_matches`: a loaded plan against a freshly planned one of the same network: the earliest
  difference (device count, a resized parameter, an op or its inputs' / outputs' shapes, the op
  count, a missing or extra parameter) is a `StrategyFileError` naming it;
  `check_device_count` / `check_params` (a file's parameters against the network's global
  shapes) are its parts, also used before planning with a loaded file's layouts.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardwise._atomic import write_text_atomically
from shardwise.planner._file_checks import first_inconsistency
from shardwise.planner._plan import (
    FORMAT,
    NodePlan,
    ParallelPlan,
    ParamPlan,
    device_num_of,
    matrix_d,
    matrix_of,
    params_d,
    params_of,
)

PARAM_FORMAT = "shardwise.ParamStrategy/1"


class StrategyFileError(ValueError):
    """A strategy file that does not match the network or the job; the message names the first
    mismatch and the fix."""


def _read(path: str | Path, what: str) -> Any:
    """The JSON in `path` (a missing or unreadable file: `StrategyFileError`)."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise StrategyFileError(f"{path}: cannot read the {what} ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise StrategyFileError(f"{path}: not a shardwise {what} ({e})") from None


def save_operator_strategy_file(plan: ParallelPlan, path: str | Path) -> None:
    """Write `plan` to `path` (JSON)."""
    write_text_atomically(path, json.dumps(plan.to_dict(), indent=1) + "\n")


def load_operator_strategy_file(path: str | Path) -> ParallelPlan:
    """Read a plan `save_operator_strategy_file` wrote (equal to the saved one)."""
    data = _read(path, "operator strategy file")
    try:
        return ParallelPlan.from_dict(data)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise StrategyFileError(f"{path}: not a shardwise operator strategy file ({e})") from None


def save_param_strategy_file(
    plan: ParallelPlan,
    path: str | Path,
    names: Collection[str] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Write the parameters' layouts of `plan` to `path` (JSON): all, or those in `names`
    (``left_out`` lists the others the plan cuts); under ``aliases`` each other state_dict name of a
    tied parameter (`aliases`: name -> the planned name of the same tensor) whose parameter
    the file holds."""
    params = plan.params if names is None else {n: p for n, p in plan.params.items() if n in names}
    sharded = {n for b in plan.buckets if b.kind == "shard" and b.shard > 1 for n in b.params}
    cut = {n for n, p in plan.params.items() if p.layout.used_axes() or n in sharded}
    data = {
        "format": PARAM_FORMAT,
        "plan_format": FORMAT,
        "device_num": plan.device_num,
        "matrix": matrix_d(plan.matrix),
        "params": params_d(params),
        "shards": {
            name: {"axes": list(b.axes), "shard": b.shard}
            for b in plan.buckets
            if b.kind == "shard" and b.shard > 1
            for name in b.params
            if name in params
        },
        "aliases": {a: n for a, n in sorted((aliases or {}).items()) if n in params},
        "left_out": sorted(n for n in cut if n not in params),
    }
    write_text_atomically(path, json.dumps(data, indent=1) + "\n")


def shards_d(shards: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Optimizer-parallel cuts (objects with ``axes``, ``shard``, ``pad``) as JSON-ready data,
    as `save_param_strategy_file` writes them."""
    return {
        n: {"axes": list(s.axes), "shard": s.shard} | ({"pad": True} if s.pad else {})
        for n, s in shards.items()
    }


def load_param_strategy_file(path: str | Path) -> tuple[int, dict[str, ParamPlan]]:
    """The device count and parameter layouts `save_param_strategy_file` wrote."""
    data = _read(path, "parameter strategy file")
    try:
        if data.get("format") != PARAM_FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        m = matrix_of(data["matrix"])
        return device_num_of(data), params_of(m, data["params"])
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise StrategyFileError(f"{path}: not a shardwise parameter strategy file ({e})") from None


def check_matches(loaded: ParallelPlan, fresh: ParallelPlan, path: str | Path) -> None:
    """Raise `StrategyFileError` at the earliest way `loaded` does not fit the network `fresh`
    was planned for, in this order: the device count; a parameter of another shape (the cause
    of every shape difference after it: a GPT-2 of another vocabulary is named by its embedding
    weight, not by the head's logits); the ops in order (name, op, inputs' and outputs' global
    shapes: an op whose inputs differ is named at that op, with the input); the op count; a
    parameter missing or extra."""
    check_device_count(loaded.device_num, fresh.device_num, path)
    shapes = {n: p.shape for n, p in fresh.params.items()}
    both = {n: p for n, p in loaded.params.items() if n in shapes}
    check_params(both, {n: s for n, s in shapes.items() if n in both}, path)
    for a, b in zip(loaded.nodes, fresh.nodes, strict=False):
        _check_node(a, b, path)
    if len(loaded.nodes) != len(fresh.nodes):
        raise StrategyFileError(
            f"{path}: the file has {len(loaded.nodes)} ops, this network {len(fresh.nodes)}"
        )
    check_params(loaded.params, shapes, path)


def _check_node(a: NodePlan, b: NodePlan, path: str | Path) -> None:
    """Raise `StrategyFileError` when op `a` of the file is not op `b` of this network: another
    op or name, an input of another shape (compared when the file records the inputs' shapes),
    another output shape."""
    fix = "the file belongs to another network or batch size"
    if (a.name, a.op) == (b.name, b.op) and a.in_shapes and a.in_shapes != b.in_shapes:
        if len(a.in_shapes) != len(b.in_shapes):
            raise StrategyFileError(
                f"{path}: op %{a.index} {a.name} ({a.op}) has {len(a.in_shapes)} tensor inputs "
                f"in the file, {len(b.in_shapes)} in this network; {fix}"
            )
        i = next(i for i, (x, y) in enumerate(zip(a.in_shapes, b.in_shapes, strict=True)) if x != y)
        value = f" ({b.values[i]})" if i < len(b.values) else ""
        raise StrategyFileError(
            f"{path}: op %{a.index} {a.name} ({a.op}) has input {i}{value} of shape "
            f"{list(a.in_shapes[i])} in the file, {list(b.in_shapes[i])} in this network; {fix}"
        )
    if (a.name, a.op, a.shapes) != (b.name, b.op, b.shapes):
        raise StrategyFileError(
            f"{path}: op %{a.index} is {a.name} ({a.op}, output shapes "
            f"{[list(s) for s in a.shapes]}) in the file but {b.name} ({b.op}, "
            f"{[list(s) for s in b.shapes]}) in this network; {fix}"
        )


def check_decisions(loaded: ParallelPlan, fresh: ParallelPlan, path: str | Path) -> None:
    """Raise `StrategyFileError` when the file's plan is not consistent with itself (an op's
    inputs placed other than its edges leave them, an edge starting elsewhere than its value
    is or taking other steps than its placements need) or runs an op it places as this
    network's plan `fresh` does with other collectives or local compute: a file edited by hand
    or written by another shardwise version (`_file_checks.first_inconsistency`). A file made
    for other annotations, or by propagation or the search, places ops its own way: it runs."""
    found = first_inconsistency(loaded, fresh)
    if found is not None:
        raise StrategyFileError(
            f"{path}: {found}; the file was edited or written by another shardwise version: "
            "save it again"
        )


def dtype_mismatch(path: str | Path, name: str, saved: str, now: str) -> StrategyFileError:
    """The error for parameter `name`, `saved` in the file's dtype, `now` in the network's."""
    return StrategyFileError(
        f"{path}: parameter {name!r} is {saved} in the file but {now} in this network; the "
        f"file belongs to the network in another dtype (cast it to {saved} before planning, "
        "or save the file again)"
    )


def check_device_count(saved: int, job: int, path: str | Path) -> None:
    """Raise `StrategyFileError` when a file saved for `saved` devices is loaded by a job of
    `job` devices."""
    if saved != job:
        raise StrategyFileError(
            f"{path}: planned for {saved} devices, the job has {job}; "
            f"plan again for this device count (or transform the checkpoint)"
        )


def check_params(
    loaded: Mapping[str, ParamPlan],
    shapes: Mapping[str, Sequence[int]],
    path: str | Path,
    optional: Collection[str] = (),
    dtypes: Mapping[str, str] | None = None,
) -> None:
    """Raise `StrategyFileError` at the first parameter of the network (name -> global shape
    in `shapes`) missing from `loaded` (unless in `optional`: a file saved with
    ``only_trainable_params`` lacks the frozen ones) or of another shape there (or of another
    dtype than in `dtypes`, when given), or the first extra one."""
    for name, shape in shapes.items():
        got = loaded.get(name)
        if got is None and name in optional:
            continue
        if got is None:
            raise StrategyFileError(f"{path}: no layout for parameter {name!r}")
        if tuple(got.shape) != tuple(shape):
            raise StrategyFileError(
                f"{path}: parameter {name!r} has shape {list(got.shape)} in the file, "
                f"{list(shape)} in this network"
            )
        if dtypes is not None and got.dtype != dtypes[name]:
            raise dtype_mismatch(path, name, got.dtype, dtypes[name])
    extra = sorted(set(loaded) - set(shapes))
    if extra:
        raise StrategyFileError(f"{path}: parameter {extra[0]!r} is not in this network")
