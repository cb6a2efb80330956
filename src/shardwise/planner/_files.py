"""Strategy files: a `ParallelPlan` kept as JSON and checked against the network on load.

- `save_operator_strategy_file` / `load_operator_strategy_file`: the whole plan (every op's
  strategy, every edge's steps, the parameters' layouts).
- `save_param_strategy_file` / `load_param_strategy_file`: the parameters' storage layouts only
  (what a checkpoint of the job needs to know).
- `check_matches`: a loaded plan against a freshly planned one of the same network: the first
  difference (device count, op, shape, parameter) is a `StrategyFileError` naming it;
  `check_device_count` / `check_params` (a file's parameters against the network's global
  shapes) are its parts, also used before planning with a loaded file's layouts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardwise.planner._plan import (
    FORMAT,
    ParallelPlan,
    ParamPlan,
    matrix_d,
    matrix_of,
    params_d,
    params_of,
)

PARAM_FORMAT = "shardwise.ParamStrategy/1"


class StrategyFileError(ValueError):
    """A strategy file that does not match the network or the job; the message names the first
    mismatch and the fix."""


def save_operator_strategy_file(plan: ParallelPlan, path: str | Path) -> None:
    """Write `plan` to `path` (JSON)."""
    plan.save(path)


def load_operator_strategy_file(path: str | Path) -> ParallelPlan:
    """Read a plan `save_operator_strategy_file` wrote (equal to the saved one)."""
    try:
        return ParallelPlan.load(path)
    except (KeyError, ValueError, json.JSONDecodeError) as e:
        raise StrategyFileError(f"{path}: not a shardwise operator strategy file ({e})") from None


def save_param_strategy_file(plan: ParallelPlan, path: str | Path) -> None:
    """Write the parameters' layouts of `plan` to `path` (JSON)."""
    data = {
        "format": PARAM_FORMAT,
        "plan_format": FORMAT,
        "device_num": plan.device_num,
        "matrix": matrix_d(plan.matrix),
        "params": params_d(plan.params),
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_param_strategy_file(path: str | Path) -> tuple[int, dict[str, ParamPlan]]:
    """The device count and parameter layouts `save_param_strategy_file` wrote."""
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        if data.get("format") != PARAM_FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        m = matrix_of(data["matrix"])
        return int(data["device_num"]), params_of(m, data["params"])
    except (KeyError, ValueError, json.JSONDecodeError) as e:
        raise StrategyFileError(f"{path}: not a shardwise parameter strategy file ({e})") from None


def check_matches(loaded: ParallelPlan, fresh: ParallelPlan, path: str | Path) -> None:
    """Raise `StrategyFileError` at the first way `loaded` does not fit the network `fresh` was
    planned for (same device count, same ops in the same order with the same shapes, same
    parameters)."""
    check_device_count(loaded.device_num, fresh.device_num, path)
    for a, b in zip(loaded.nodes, fresh.nodes, strict=False):
        if (a.name, a.op, a.shapes) != (b.name, b.op, b.shapes):
            raise StrategyFileError(
                f"{path}: op %{a.index} is {a.name} ({a.op}, output shapes "
                f"{[list(s) for s in a.shapes]}) in the file but {b.name} ({b.op}, "
                f"{[list(s) for s in b.shapes]}) in this network; the file belongs to another "
                f"network or batch size"
            )
    if len(loaded.nodes) != len(fresh.nodes):
        raise StrategyFileError(
            f"{path}: the file has {len(loaded.nodes)} ops, this network {len(fresh.nodes)}"
        )
    check_params(loaded.params, {n: p.shape for n, p in fresh.params.items()}, path)


def check_device_count(saved: int, job: int, path: str | Path) -> None:
    """Raise `StrategyFileError` when a file saved for `saved` devices is loaded by a job of
    `job` devices."""
    if saved != job:
        raise StrategyFileError(
            f"{path}: planned for {saved} devices, the job has {job}; "
            f"plan again for this device count (or transform the checkpoint)"
        )


def check_params(
    loaded: Mapping[str, ParamPlan], shapes: Mapping[str, Sequence[int]], path: str | Path
) -> None:
    """Raise `StrategyFileError` at the first parameter of the network (name -> global shape
    in `shapes`) missing from `loaded` or of another shape there, or the first extra one."""
    for name, shape in shapes.items():
        got = loaded.get(name)
        if got is None:
            raise StrategyFileError(f"{path}: no layout for parameter {name!r}")
        if tuple(got.shape) != tuple(shape):
            raise StrategyFileError(
                f"{path}: parameter {name!r} has shape {list(got.shape)} in the file, "
                f"{list(shape)} in this network"
            )
    extra = sorted(set(loaded) - set(shapes))
    if extra:
        raise StrategyFileError(f"{path}: parameter {extra[0]!r} is not in this network")
