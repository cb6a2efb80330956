"""Which wrapper runs a network: one `AutoParallel` per network at a time.

`take_over` is called when a wrapper is built: an earlier wrapper of the same network that
never ran gives up its hooks and refuses later calls (a notebook cell that builds the wrapper,
run again); one that already ran is kept, and the new one is refused with the fix.
`refuse_shared` keeps a parameter that two wrapped networks share (an encoder of two heads)
whole: each wrapper captures and runs the parameters as it finds them, so one that another
wrapper's plan stores as blocks or optimizer-parallel shards (or one that a data_parallel
runner averages at its optimizer step) is refused, naming both networks and the fix.
`stored_plan` answers, for checkpoints, the plan a network's parameters are stored by (also
after its wrapper is gone: `stored` records the run); a
deep copy of a planned network (an EMA model) is recorded by `copied` as stored by the same plan,
its hooks bound to a `CopiedHooks`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:
    from shardwise.planner import ParallelPlan


class Wrapper(Protocol):
    """What `take_over` needs of a wrapper (`AutoParallel`)."""

    _superseded: bool
    removed: bool
    parallel_mode: str
    train_step: Callable[..., Any] | None

    @property
    def has_run(self) -> bool: ...

    def remove(self) -> None: ...

    @property
    def stored_plan(self) -> ParallelPlan | None: ...


_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Wrapper]] = weakref.WeakKeyDictionary()
"""Each network's current wrapper (the last `AutoParallel` built on it)."""


def take_over(network: nn.Module, wrapper: Wrapper) -> None:
    """Make `wrapper` the network's wrapper: an earlier one that never ran gives up its hooks
    (and refuses later calls), as when a notebook cell that builds the wrapper runs again.

    Raises:
        ValueError: an earlier wrapper already ran (semi_auto: the parameters hold this rank's
            blocks; data_parallel: its optimizer hooks average the gradients).
    """
    ref = _WRAPPERS.get(network)
    old = None if ref is None else ref()
    held = _RUNS.get(network)
    if old is None and held is not None and held() is not None:  # (its wrapper dropped)
        raise ValueError(
            f"AutoParallel: {type(network).__name__} was planned by an earlier AutoParallel, "
            "now dropped, and its parameters still hold this rank's blocks; keep that wrapper "
            "and call it, or build the network (and its optimizer) again before wrapping it"
        )
    if old is not None and old is not wrapper:
        if old.has_run:
            raise ValueError(
                f"AutoParallel: {type(network).__name__} is already run by an earlier "
                "AutoParallel (semi_auto: its parameters hold this rank's blocks; data_parallel: "
                "its optimizer hooks average the gradients); keep calling that wrapper, or build "
                "the network (and its optimizer) again before wrapping it. One network is run "
                "by one wrapper: to train and evaluate it, wrap one step that branches on a "
                "flag (step(x, y, train=False); docs/parallel.md, 'Training and evaluation in "
                "one step')"
            )
        old.remove()
        old._superseded = True
    _WRAPPERS[network] = weakref.ref(wrapper)


def cut_names(plan: ParallelPlan) -> set[str]:
    """The parameters `plan` stores cut on this rank: split blocks, or optimizer-parallel
    shards (its ``"shard"`` buckets)."""
    names = {n for n, p in plan.params.items() if p.layout.used_axes()}
    return names | {n for b in plan.buckets if b.kind == "shard" and b.shard > 1 for n in b.params}


def _others(network: nn.Module) -> Iterator[tuple[nn.Module, str, set[str] | None, bool]]:
    """Every other network a wrapper ran (its wrapper kept, or removed or dropped with its
    parameters still cut): the network, how it names that wrapper, the names its plan stores
    cut (None: data_parallel mode, whose runner averages every parameter at its optimizer
    step), and whether that wrapper still runs (a removed or dropped one runs nothing more:
    only the parameters it left cut matter)."""
    for other in list(_WRAPPERS.keys()) + [n for n in list(_RUNS.keys()) if n not in _WRAPPERS]:
        if other is network:
            continue
        ref = _WRAPPERS.get(other)
        wrapper = None if ref is None else ref()
        if wrapper is not None and not wrapper._superseded and wrapper.has_run:
            plan = wrapper.stored_plan
            if plan is None and (wrapper.parallel_mode != "data_parallel" or wrapper.removed):
                continue  # (a removed data_parallel runner averages nothing more)
            what = _called(other, wrapper.train_step)
            if wrapper.removed:
                yield other, f"{what} (removed)", cut_names(plan) if plan else set(), False
            else:
                yield other, what, None if plan is None else cut_names(plan), True
        elif wrapper is None and (held := _RUNS.get(other)) is not None:
            run = held()
            if run is not None:
                what = f"{_called(other, None)} (its wrapper dropped)"
                yield other, what, cut_names(run.stored_plan), False


def _called(network: nn.Module, step: Callable[..., Any] | None) -> str:
    name = getattr(step, "__name__", type(step).__name__) if step is not None else None
    net = type(network).__name__
    return f"AutoParallel({name}) (network {net})" if name else f"AutoParallel({net})"


def refuse_shared(
    network: nn.Module,
    step: Callable[..., Any] | None,
    cut: Collection[str] = (),
    data_parallel: bool = False,
) -> None:
    """Refuse to plan (or, `data_parallel`, to run) `network`, wrapped with train step `step`,
    when it shares a parameter (the same object) with another wrapper's network and either
    stores it cut (this plan's `cut` names, or the other's stored plan) or runs it in
    data_parallel mode: the other wrapper's capture would read this rank's block as the whole
    parameter, or its gradient be averaged twice.

    Raises:
        ValueError: naming the parameter, both wrappers and the fix.
    """
    mine: dict[int, list[str]] = {}  # (a tied parameter: every name, the first first)
    for n, p in network.named_parameters(remove_duplicate=False):
        mine.setdefault(id(p), []).append(n)
    for other, what, theirs, active in _others(network):
        for name, p in other.named_parameters(remove_duplicate=False):
            names = mine.get(id(p))
            if names is None:
                continue
            here = names[0]
            if active and (theirs is None or data_parallel):
                why = "data_parallel mode averages each parameter's gradient at its wrapper's "
                why += "optimizer step, and one wrapper's optimizers cannot step another's"
            elif theirs is not None and name in theirs:
                why = "its plan stores it as this rank's block (or optimizer-parallel shard), "
                why += "which this wrapper would take for the whole parameter"
            elif active and any(n in cut for n in names):
                why = "this wrapper's plan would store it as this rank's block (or "
                why += "optimizer-parallel shard), which that wrapper runs as the whole parameter"
            else:
                continue  # (whole in both: each runs it as it is)
            raise ValueError(
                f"{_called(network, step)}: parameter {here!r} of its network is also "
                f"{name!r} of the network of another {what}, which already ran; {why}. A "
                "parameter shared by two wrapped networks must stay whole in both (no split, "
                "no hsdp, semi_auto); else wrap one module holding both heads "
                "(nn.ModuleDict(a=net_a, b=net_b)), or one train step computing both losses "
                "(docs/parallel.md, 'A parameter shared between wrappers')"
            )


class CopiedHooks:
    """What the hooks of a deep copy of a planned network are bound to (``copy.deepcopy(net)``
    after the first call: an EMA model, a snapshot): `GraphRun`'s hook methods, run by no
    executor. A copy of whole parameters runs as plain torch; a copy of blocks or shards
    refuses to run (`NetworkHooks._network_called`)."""

    executor = None
    copied = True

    def __init__(self, blocks: bool) -> None:
        self.blocks, self.capturing = blocks, not blocks


_COPIES: weakref.WeakKeyDictionary[nn.Module, ParallelPlan] = weakref.WeakKeyDictionary()
"""Deep copies of planned networks (an EMA model) -> the plan their blocks are stored by."""


def copied(copy: nn.Module, network: nn.Module) -> None:
    """Record that `copy` (``copy.deepcopy(network)`` after its first call) holds blocks
    stored by `network`'s plan, so that its checkpoint describes its cut."""
    plan = stored_plan(network)
    if plan is not None:
        _COPIES[copy] = plan


class _Stored(Protocol):
    @property
    def stored_plan(self) -> ParallelPlan: ...


_RUNS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[_Stored]] = weakref.WeakKeyDictionary()
"""Planned networks -> their run (`GraphRun`), for `stored_plan` after the wrapper is gone
(the network's hooks keep the run alive, and its parameters stay cut); weak both ways (the run
holds the network: a strong value would keep the key alive for ever)."""


def stored(network: nn.Module, run: _Stored) -> None:
    """Record that `run` planned `network` (its parameters now stored by its first plan)."""
    _RUNS[network] = weakref.ref(run)


def stored_plan(network: nn.Module) -> ParallelPlan | None:
    """The plan by which `network`'s parameters (and its optimizer's state) are stored on this
    rank: its wrapper's first plan, with the optimizer-parallel buckets, also once the wrapper
    itself is gone; None when no wrapper has cut them (not planned yet, or data_parallel)."""
    ref = _WRAPPERS.get(network)
    wrapper = None if ref is None else ref()
    if wrapper is None:
        held = _RUNS.get(network)
        run = None if held is None else held()
        return run.stored_plan if run is not None else _COPIES.get(network)
    return None if wrapper._superseded else wrapper.stored_plan
