"""MindSpore's older global parallel style: `set_auto_parallel_context` and `ParallelMode`.

`set_auto_parallel_context(**kw)` validates and stores process-wide settings;
`get_auto_parallel_context(name)` reads one back and `reset_auto_parallel_context()` restores
the defaults. `AutoParallel` reads these when it is created or plans:

- ``parallel_mode`` (with ``search_mode``): the wrapper's mode when no ``parallel_mode`` is
  passed to it (`resolve_parallel_mode`). ``SEMI_AUTO_PARALLEL`` and ``STAND_ALONE`` (the
  default: the wrapper's own default) run semi_auto, ``DATA_PARALLEL`` the data-parallel mode,
  ``AUTO_PARALLEL`` with ``search_mode="sharding_propagation"`` sharding propagation, with
  ``"recursive_programming"`` (the default) the strategy search; ``"dynamic_programming"`` is
  not supported (`UnsupportedParallelError`). `train.Model` reads it too:
  any mode but ``STAND_ALONE`` runs its train step through `AutoParallel`.
- ``dataset_strategy``: the wrapper's dataset strategy unless ``dataset_strategy()`` is called.
- ``device_num``: when set, must equal the job's world size at plan time (`check_device_num`).
- ``enable_parallel_optimizer`` with ``parallel_optimizer_config``, and ``comm_fusion``: the
  wrapper's optimizer parallel and fusion buckets unless ``hsdp()`` / ``comm_fusion()`` are
  called (`parallel._hsdp.settings_from_context`).

- ``strategy_ckpt_config``: ``load_file`` is loaded as the wrapper's parameter strategy file
  when it is created, ``save_file`` written when it plans (``only_trainable_params``, default
  True: only parameters that require a gradient); semi_auto only (`parallel._strategy_files`).

- ``watch_every_op``: read when a semi_auto `AutoParallel` plans: True (default), the executor
  examines every op; False, modules of local ops run unwatched (`parallel._spans`).

``gradients_mean`` is validated and stored only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from shardwise.optim import check_fusion
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._step import DatasetStrategy, check_dataset_strategy


class ParallelMode:
    """The ``parallel_mode`` values of `set_auto_parallel_context` (MindSpore's names)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    MODES = (STAND_ALONE, DATA_PARALLEL, SEMI_AUTO_PARALLEL, AUTO_PARALLEL)


SEARCH_MODES = ("recursive_programming", "sharding_propagation", "dynamic_programming")
OPTIMIZER_LEVELS = ("level1", "level2", "level3")
FUSION_MODES = ("auto", "size", "index")
FUSION_KEYS = ("openstate", "allreduce", "allgather", "reducescatter")
CKPT_KEYS = ("load_file", "save_file", "only_trainable_params")

_DEFAULTS: dict[str, Any] = {
    "parallel_mode": ParallelMode.STAND_ALONE,
    "search_mode": "recursive_programming",
    "device_num": None,
    "dataset_strategy": "data_parallel",
    "gradients_mean": False,
    "enable_parallel_optimizer": False,
    "parallel_optimizer_config": {},
    "comm_fusion": {},
    "strategy_ckpt_config": {},
    "watch_every_op": True,
}
_CONTEXT: dict[str, Any] = copy.deepcopy(_DEFAULTS)


def _bad(key: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"set_auto_parallel_context: {key}={value!r} is invalid; valid: {valid}")


def _choice(options: tuple[str, ...]) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value not in options:
            raise _bad(key, value, " | ".join(repr(o) for o in options))
        return value

    return check


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(key, value, "True | False")
    return value


def _device_num(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise _bad(key, value, "an int in [1, 4096]")
    return value


def _mapping(key: str, value: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(key, value, f"a dict with keys among {keys}")
    unknown = [k for k in value if k not in keys]
    if unknown:
        raise _bad(key, value, f"a dict with keys among {keys} (unknown: {unknown})")
    return dict(value)


def _optimizer_config(key: str, value: Any) -> dict[str, Any]:
    keys = ("parallel_optimizer_threshold", "optimizer_weight_shard_size", "optimizer_level")
    out = _mapping(key, value, keys)
    threshold = out.get("parallel_optimizer_threshold", 0)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise _bad(f"{key}['parallel_optimizer_threshold']", threshold, "an int >= 0 (KB)")
    size = out.get("optimizer_weight_shard_size", -1)
    if isinstance(size, bool) or not isinstance(size, int) or not (size == -1 or size > 1):
        raise _bad(f"{key}['optimizer_weight_shard_size']", size, "-1 or an int > 1")
    level = out.get("optimizer_level", "level1")
    if level not in OPTIMIZER_LEVELS:
        raise _bad(
            f"{key}['optimizer_level']", level, " | ".join(repr(o) for o in OPTIMIZER_LEVELS)
        )
    return out


def _comm_fusion(key: str, value: Any) -> dict[str, Any]:
    out = _mapping(key, value, FUSION_KEYS)
    for name, sub in out.items():
        if name == "openstate":
            _bool(f"{key}['openstate']", sub)
            continue
        fusion = _mapping(f"{key}[{name!r}]", sub, ("mode", "config"))
        if fusion.get("mode", "auto") not in FUSION_MODES:
            raise _bad(
                f"{key}[{name!r}]['mode']",
                fusion.get("mode"),
                " | ".join(repr(m) for m in FUSION_MODES),
            )
    try:  # (each mode's config: the check of AutoParallel.comm_fusion)
        check_fusion(out)
    except ValueError as e:
        raise ValueError(f"set_auto_parallel_context: {e}") from None
    except TypeError as e:
        raise TypeError(f"set_auto_parallel_context: {e}") from None
    return copy.deepcopy(out)


def _ckpt_config(key: str, value: Any) -> dict[str, Any]:
    out = _mapping(key, value, CKPT_KEYS)
    for name in ("load_file", "save_file"):
        if name in out and not isinstance(out[name], str):
            raise _bad(f"{key}[{name!r}]", out[name], "a str path")
    if "only_trainable_params" in out:
        _bool(f"{key}['only_trainable_params']", out["only_trainable_params"])
    return out


def _dataset_strategy(key: str, value: Any) -> DatasetStrategy:
    return check_dataset_strategy(value)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "parallel_mode": _choice(ParallelMode.MODES),
    "search_mode": _choice(SEARCH_MODES),
    "device_num": _device_num,
    "dataset_strategy": _dataset_strategy,
    "gradients_mean": _bool,
    "enable_parallel_optimizer": _bool,
    "parallel_optimizer_config": _optimizer_config,
    "comm_fusion": _comm_fusion,
    "strategy_ckpt_config": _ckpt_config,
    "watch_every_op": _bool,
}


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Set global parallel options (MindSpore's ``set_auto_parallel_context``).

    All values are checked before any is stored: a bad call changes nothing.

    Args:
        parallel_mode: a `ParallelMode` value (default ``"stand_alone"``).
        search_mode: ``"recursive_programming"`` (default), ``"sharding_propagation"`` or
            ``"dynamic_programming"`` (for ``AUTO_PARALLEL``; the last is not supported).
        device_num: the job's size, an int in [1, 4096]; checked against the world size when
            `AutoParallel` plans. Default None (not checked).
        dataset_strategy: ``"data_parallel"`` (default), ``"full_batch"`` or one int tuple /
            Layout call per input (see `AutoParallel.dataset_strategy`).
        gradients_mean: bool (stored only).
        enable_parallel_optimizer: bool; True turns on optimizer parallel in `AutoParallel`
            (as its ``hsdp()``), with ``parallel_optimizer_config``.
        parallel_optimizer_config: dict of ``parallel_optimizer_threshold`` (int >= 0, KB;
            default 64), ``optimizer_weight_shard_size`` (-1 or > 1), ``optimizer_level``
            (``"level1"`` / ``"level2"`` / ``"level3"``).
        comm_fusion: dict of ``openstate`` (bool) and ``allreduce`` / ``allgather`` /
            ``reducescatter`` (``{"mode": "auto" | "size" | "index", "config": ...}``); the
            buckets of `AutoParallel` (as its ``comm_fusion()``).
        strategy_ckpt_config: dict of ``load_file`` / ``save_file`` (str paths of parameter
            strategy files: loaded when a semi_auto `AutoParallel` is created, written when it
            plans) and ``only_trainable_params`` (bool, default True: save only parameters
            that require a gradient).
        watch_every_op: bool (default True: the plan executor examines every op of every
            step, so a module whose ops change from one call to the next is planned again).
            False: from a plan's third call modules of local ops run unwatched and the
            executor stays off after an optimizer step (`parallel._spans`): less Python per
            step, but new ops inside such a module (a branch on a Python flag) run unchecked.

    Raises:
        ValueError: an unknown key or an invalid value; the message names the key and the
            valid values.
    """
    checked: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key not in _CHECKS:
            raise ValueError(
                f"set_auto_parallel_context: unknown key {key!r}; valid keys: {sorted(_CHECKS)}"
            )
        checked[key] = _CHECKS[key](key, value)
    _CONTEXT.update(checked)


def get_auto_parallel_context(name: str) -> Any:
    """The value of one `set_auto_parallel_context` option (a copy for dict options).

    Raises:
        ValueError: unknown option (the message lists the known ones).
    """
    if name not in _CONTEXT:
        raise ValueError(
            f"get_auto_parallel_context: unknown key {name!r}; valid keys: {sorted(_CONTEXT)}"
        )
    return copy.deepcopy(_CONTEXT[name])


def reset_auto_parallel_context() -> None:
    """Restore every `set_auto_parallel_context` option to its default."""
    _CONTEXT.clear()
    _CONTEXT.update(copy.deepcopy(_DEFAULTS))


def resolve_parallel_mode(explicit: str | None) -> str:
    """The wrapper's mode: ``"semi_auto"``, ``"sharding_propagation"``,
    ``"recursive_programming"`` or ``"data_parallel"``: `explicit` when given (one of those,
    or a `ParallelMode` / MindSpore name, read as the context reads it), else from the
    context (``AUTO_PARALLEL`` takes its ``search_mode``).

    Raises:
        UnsupportedParallelError: ``search_mode="dynamic_programming"`` (not implemented).
        ValueError: an unknown explicit mode.
    """
    modes = ("semi_auto", "sharding_propagation", "recursive_programming", "data_parallel")
    if explicit is None:
        return _from_mindspore_mode(_CONTEXT["parallel_mode"], explicit=False)
    if explicit in modes:
        return explicit
    if explicit in ParallelMode.MODES:
        return _from_mindspore_mode(explicit, explicit=True)
    raise ValueError(
        f"AutoParallel: parallel_mode {explicit!r}; valid: "
        + " | ".join(repr(m) for m in modes)
        + ", or MindSpore's names (sw.ParallelMode: "
        + " | ".join(repr(m) for m in ParallelMode.MODES)
        + ")"
    )


def _from_mindspore_mode(mode: str, explicit: bool) -> str:
    """A `ParallelMode` value as the wrapper's mode (`explicit`: given to `AutoParallel`, not
    read from the context)."""
    if mode in (ParallelMode.STAND_ALONE, ParallelMode.SEMI_AUTO_PARALLEL):
        return "semi_auto"
    if mode == ParallelMode.DATA_PARALLEL:
        return "data_parallel"
    search = _CONTEXT["search_mode"]
    if search in ("sharding_propagation", "recursive_programming"):
        return str(search)
    setting = (
        f"set_auto_parallel_context(parallel_mode={mode!r}, search_mode={search!r})"
        if not explicit
        else f"AutoParallel(parallel_mode={mode!r}) with the context's search_mode={search!r}"
    )
    raise UnsupportedParallelError(
        f"AutoParallel: {setting} is not supported; use search_mode='recursive_programming' "
        f"or 'sharding_propagation', or ParallelMode.SEMI_AUTO_PARALLEL"
    )


def check_device_num(world: int) -> None:
    """Raise ValueError when the context's ``device_num`` is set and differs from `world`."""
    device_num = _CONTEXT["device_num"]
    if device_num is not None and device_num != world:
        raise ValueError(
            f"AutoParallel: set_auto_parallel_context(device_num={device_num}) but the job has "
            f"{world} ranks (communication.get_group_size()); set device_num={world} or leave "
            f"it unset"
        )
