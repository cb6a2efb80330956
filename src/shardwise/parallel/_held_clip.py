"""torch's gradient clipping outside a wrapped call (the module form, or the clipping in the
user's loop around a wrapped step).

Inside a wrapped call torch's clipping takes the norm of the whole gradients (`_clip`); outside
one torch's own functions would see only this rank's pieces. `watch` registers an hsdp engine
with its wrapper's `_clip.clipping` arguments (`clip_args`), `watch_blocks` a semi_auto run
without hsdp (its parameters stored split, `Blocks`), and from then on:

- levels 2 and 3 (and level 1 once its gradients are reduced) hold each parameter's reduced
  shard in ``.grad``, a wrapper without hsdp this rank's block of each split parameter's:
  ``torch.nn.utils.clip_grad_norm_`` (any name it was imported by) and
  ``torch.nn.utils.get_total_norm`` (by that path) given some of those gradients take the
  norm of the whole gradients, each shard or block counted once (`_clip._TotalNorm`), so
  every rank clips by one device's norm; ``clip_grad_value_`` clamps each element and needs
  nothing (torch's own); gradients of no split parameter (plain data parallel) are left to
  torch;
- one clipping may list the gradients of several wrappers' parameters and other tensors (a
  plain module's): each gradient is normed by the splits of the wrapper whose parameter holds
  it, any other tensor whole as torch counts it (`JointSplits`), and every engine holding
  level-1 gradients the clipping is given is reduced first;
- level 1 keeps each rank's full gradients on the compute leaves until the optimizer step
  (every held parameter's ``.grad`` is None): while it holds them and the gradients a clipping
  lists are none or some of its parameters' (`_given`), ``clip_grad_norm_`` clips as inside a
  wrapped call: the held gradients reduced first (the ReduceScatter the step would run, moved
  earlier; the step then reduces none), the norm that of the whole gradients, taken when torch
  scales them (`_clip._TotalNorm.scale`); ``clip_grad_value_`` and ``get_total_norm``, which
  list the ``.grad`` tensors before shardwise sees the call (the held ones are missing), raise
  a ValueError naming level 1, a held parameter and the fixes;
- ``parallel_mode="data_parallel"`` (`watch_data_parallel`) keeps each rank's own gradients
  until the optimizer step all-reduces them: a clipping (by norm or value) or
  ``get_total_norm`` given one of them before that step raises the ValueError
  `DATA_PARALLEL_OUTSIDE`, as inside a wrapped step.

The guards sit in front of torch's clipping steps from the first watched wrapper on
(`_torch.clip_grad.guard_clipping`); given no gradient of a watched wrapper's parameters they
change nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from shardwise._torch.clip_grad import guard_clipping
from shardwise.parallel._clip import GradSplit, PlanSplits, _TotalNorm


class _Engine(Protocol):
    @property
    def params(self) -> dict[str, torch.nn.Parameter]: ...

    @property
    def leaves(self) -> dict[str, torch.Tensor]: ...

    def reduce_held(self, reduce: bool = True) -> bool: ...


class _Runner(Protocol):
    def unreduced(self, grads: Sequence[torch.Tensor]) -> str | None: ...


ClipArgs = Callable[[], tuple[PlanSplits, str, Callable[[bool], bool] | None]]

_WATCHED: weakref.WeakKeyDictionary[Any, weakref.WeakMethod[ClipArgs]] = weakref.WeakKeyDictionary()
_SCALING: dict[int, _TotalNorm] = {}  # id(the norm torch got) -> what scales by it
_GUARDING: list[bool] = []
_RUNNERS: weakref.WeakSet[Any] = weakref.WeakSet()  # (data_parallel mode's: `watch_data_parallel`)

REFUSED = (
    "{what} outside the wrapped call with hsdp optimizer_level 'level1': parameter {name!r}'s "
    "gradient is held unreduced on the compute weights until the optimizer step (its .grad is "
    "None until then), so {missed}; use optimizer_level='level2' or 'level3' (gradients "
    "reduced in backward), the train-step form (AutoParallel(step) with the clipping inside "
    "the step), or clip by norm: torch.nn.utils.clip_grad_norm_ or parallel.clip_grad_norm_ "
    "(they reduce the held gradients first)"
)


DATA_PARALLEL_OUTSIDE = (
    "{what} outside the wrapped call under parallel_mode='data_parallel': parameter {name!r}'s "
    "gradient is this rank's own until the optimizer step all-reduces it, so each rank would "
    "{missed}; use parallel_mode='semi_auto' (the same data-parallel plan, gradients reduced "
    "in backward), where torch's clipping takes the whole gradients"
)
_DP_WHAT = {
    "total_norm": ("torch.nn.utils.clip_grad_norm_", "clip by another norm"),
    "group": ("torch.nn.utils.clip_grad_value_", "clip its own gradient"),
    "public": ("torch.nn.utils.get_total_norm", "take another norm"),
}


def watch(engine: _Engine, clip_args: ClipArgs) -> None:
    """Guard torch's clipping for `engine` (`clip_args`: its wrapper's bound `clip_args`, held
    weakly)."""
    _WATCHED[engine] = weakref.WeakMethod(clip_args)
    _start()


def watch_blocks(network: torch.nn.Module, clip_args: ClipArgs) -> Blocks:
    """Guard torch's clipping for a semi_auto run of `network` without hsdp (`clip_args`: its
    bound `clip_args`, held weakly); the returned `Blocks` is watched while the run holds it.

    Example:
        >>> self.clip_watch = watch_blocks(self.network, self.clip_args)  # doctest: +SKIP
    """
    blocks = Blocks(network, clip_args)
    watch(blocks, clip_args)
    return blocks


def watch_data_parallel(runner: _Runner) -> None:
    """Refuse torch's clipping outside a wrapped call over gradients `runner` (a data_parallel
    mode runner, held weakly) has not all-reduced yet (`DATA_PARALLEL_OUTSIDE`)."""
    _RUNNERS.add(runner)
    _start()


def _start() -> None:
    if not _GUARDING:
        guard_clipping(_guard)
        _GUARDING.append(True)


class Blocks:
    """A semi_auto run without hsdp as the guard sees it: `params` its parameters stored split
    (this rank's block in ``.grad``); it holds no gradient back."""

    def __init__(self, network: torch.nn.Module, clip_args: ClipArgs) -> None:
        self.network, self.clip_args = network, weakref.WeakMethod(clip_args)
        self.leaves: dict[str, torch.Tensor] = {}

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        clip_args = self.clip_args()
        if clip_args is None:
            return {}
        splits = clip_args()[0]
        named = self.network.named_parameters()
        return {n: p for n, p in named if splits.split(n) is not None}

    def reduce_held(self, reduce: bool = True) -> bool:
        return False


def _guard(step: str, args: tuple[Any, ...]) -> Callable[..., Any] | None:
    if step == "scale":
        total = _SCALING.pop(id(args[2]), None) if len(args) > 2 else None
        return None if total is None else total.scale
    grads = _listed(step, args)
    for runner in list(_RUNNERS):
        name = runner.unreduced(grads)
        if name is not None:
            what, missed = _DP_WHAT[step]
            raise ValueError(DATA_PARALLEL_OUTSIDE.format(what=what, name=name, missed=missed))
    live = [(engine, method()) for engine, method in list(_WATCHED.items())]
    engines = [(engine, clip_args) for engine, clip_args in live if clip_args is not None]
    holding = {id(engine) for engine, _ in engines if engine.reduce_held(False)}
    given = [engine for engine, _ in engines if id(engine) in holding and _given(engine, grads)]
    if given and step != "total_norm":
        what, missed = {
            "group": ("torch.nn.utils.clip_grad_value_", "nothing would be clipped"),
            "public": ("torch.nn.utils.get_total_norm", "its norm would leave it out"),
        }[step]
        raise ValueError(REFUSED.format(what=what, name=_held(given[0]), missed=missed))
    if step == "group":
        return None  # (value clipping is per element: the shards' own is one device's)
    owners = [
        (engine, clip_args)
        for engine, clip_args in engines
        if any(engine is e for e in given) or (id(engine) not in holding and _mine(engine, grads))
    ]
    if not owners:
        return None
    reduce_first = _reduce_all(given) if given else None
    total = _TotalNorm(JointSplits(owners), "", reduce_first, where=OUTSIDE)
    if step == "public":
        return total.public
    if given:
        return lambda *a, **k: _deferred(total, total(*a, **k))
    return total


OUTSIDE = "outside the wrapped call"


class JointSplits:
    """The `GradSplits` of gradients listed to one clipping outside a wrapped call: each
    gradient of a watched wrapper's parameters (`owners`, with their `clip_args`) split as
    that wrapper says, any other tensor (a plain module's gradient) whole, as
    torch counts it."""

    def __init__(self, owners: list[tuple[_Engine, ClipArgs]]) -> None:
        self.owners = owners

    def __call__(self, grads: Sequence[torch.Tensor]) -> list[GradSplit]:
        splits: list[GradSplit] = [None] * len(grads)
        found = [False] * len(grads)
        for _, clip_args in self.owners:
            plan = clip_args()[0]
            for i, name in enumerate(plan.names(grads)):
                if name is not None and not found[i]:
                    splits[i], found[i] = plan.split(name), True
        return splits


def _reduce_all(engines: list[_Engine]) -> Callable[[bool], bool]:
    """`_TotalNorm`'s `reduce_first` for several engines holding gradients (level 1)."""

    def reduce_first(reduce: bool) -> bool:
        return any([engine.reduce_held(reduce) for engine in engines])

    return reduce_first


def _deferred(total: _TotalNorm, norm: torch.Tensor) -> torch.Tensor:
    """The norm `total` returned, remembered for its scaling step when it is taken there."""
    if id(norm) in total.deferred:
        _SCALING[id(norm)] = total
    return norm


def _listed(step: str, args: tuple[Any, ...]) -> list[Any]:
    """The gradients the clipping step was given (``_group_tensors_by_device_and_dtype`` takes
    a list of tensor lists)."""
    if not args:
        return []
    first = args[0]
    if isinstance(first, torch.Tensor):
        return [first]
    listed = list(first)
    if step == "group":
        listed = [t for inner in listed for t in inner]
    return [t for t in listed if isinstance(t, torch.Tensor)]


def _given(engine: _Engine, grads: list[Any]) -> bool:
    """Whether the clipping is of `engine`'s parameters while level 1 holds gradients: no
    gradient listed (the held ones are None), or one of them a parameter's (a member reduced
    in backward)."""
    return not grads or _mine(engine, grads)


def _mine(engine: _Engine, grads: list[Any]) -> bool:
    """Whether some gradient in `grads` is one of `engine`'s parameters' ``.grad``."""
    mine = {id(p.grad) for p in engine.params.values() if p.grad is not None}
    return any(id(g) in mine for g in grads)


def _held(engine: _Engine) -> str:
    """The first parameter whose gradient the engine holds."""
    return next((n for n, leaf in engine.leaves.items() if leaf.grad is not None), "?")
