"""A call stopped midway to be run again (`parallel._errors.Replan`): what it
changed, and which known plan fits it.

- `snapshot(modules)`: the modules' buffers (copies) and the RNG state (the CPU's generator,
  CUDA's when initialized, a simulated world's per-rank ones: `communication.draw_state`)
  before a call; `Snapshot.restore` undoes the stopped attempt's changes to them (BatchNorm
  statistics, draws).
- `known_variant(plans, plan, shapes, stop)`: the one plan kept for these inputs whose first ops
  are the ones that ran and whose next op is the one called (or which ends there), each on the
  same parameters (`_param_reads`: a head picked by a flag runs the same ops on others), and,
  where an op's sizes differed from the captured ones (``table[n]``), which has this call's.
- `same_sizes(a, b)`: whether two plans were captured with the same sizes (an equal plan
  captured with other ones is another variant).
- `ByFlags`: the plan a call with the same flags last ran (its arguments that are not tensors:
  bools, strings, None, ``train=False``), to start the next such call with: a step whose
  branches follow a flag (train / eval) no longer starts each call with the other branch's
  plan, stops where they part and runs again.
- `keep_few(plans, tables, reason)`: after a new plan, a warning when a network has more than
  `WARN_PLANS` (each new input signature costs a capture and a plan), and at most `MOST_PLANS`
  kept (the oldest after the first, which stores the parameters, dropped).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise._torch.module_state import own_buffers
from shardwise.parallel._errors import Replan
from shardwise.parallel._param_reads import fits, node_reads
from shardwise.parallel._sizes import flatten_call
from shardwise.planner import NodePlan, ParallelPlan

Variant = tuple[ParallelPlan, list[tuple[Any, Any]]]
WARN_PLANS = 8  # (plans of one network past which a new one warns, once)
MOST_PLANS = 64  # (plans of one network kept: the oldest after the first dropped past it)
"""A plan and the argument templates of its nodes."""


@dataclass
class Snapshot:
    """Buffers (each with its copy) and the RNG state, taken by `snapshot`."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    rng: Any  # (`communication.draw_state`: the CPU's generator, CUDA's when initialized)

    def restore(self) -> None:
        """Put the buffers and the RNG state back; other Python state a call changed stays."""
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        comm.set_draw_state(self.rng)


def snapshot(modules: Sequence[nn.Module]) -> Snapshot:
    """The buffers of `modules` (the ones holding buffers, listed once when planning; each
    one's buffers read anew) and the RNG state.

    Example:
        >>> state = snapshot([bn])
        >>> state.restore()
    """
    with torch.no_grad():
        held = (b for m in modules for b in own_buffers(m).values() if b is not None)
        buffers = [(b, b.clone()) for b in held]
    return Snapshot(buffers, comm.draw_state())


def known_variant(
    plans: Sequence[Variant], plan: ParallelPlan, shapes: dict[str, Any], stop: Replan
) -> Variant | None:
    """The one plan of `plans` other than `plan` for inputs of `shapes` whose first ops are
    `plan`'s up to where the call stopped (`stop.cursor`) and whose next op is the one called
    there (`stop.op`; None: the call ended), each reading the same parameters (`stop.params`)
    and, for a call stopped by its sizes, captured with them (`stop.sizes`);
    None when no plan or several fit.

    Example:
        >>> known_variant(run.plans, run.parallel_plan, shapes, stop)  # doctest: +SKIP
    """
    ran = [(n.op, node_reads(n)) for n in plan.nodes[: stop.cursor]]
    found = []
    for variant in plans:
        nodes = variant[0].nodes
        if variant[0] is plan or dict(variant[0].input_shapes) != shapes:
            continue
        if [(n.op, node_reads(n)) for n in nodes[: stop.cursor]] != ran:
            continue
        ends = stop.op is None and len(nodes) == stop.cursor
        if ends or (len(nodes) > stop.cursor and _next_is(nodes[stop.cursor], stop, variant)):
            found.append(variant)
    return found[0] if len(found) == 1 else None


def _same_sizes(template: tuple[Any, Any], stop: Replan) -> bool:
    """Whether a plan's captured call `template` of the node `stop` met has the sizes the call
    had there (`Replan.sizes`: ``table[n]``, a plan per `n`); True when it stopped otherwise."""
    if stop.sizes is None:
        return True
    leaves, _ = flatten_call(tuple(template[0]), dict(template[1]))
    return all(i < len(leaves) and _equal(leaves[i], x) for i, x in stop.sizes)


def same_sizes(a: Sequence[tuple[Any, Any]], b: Sequence[tuple[Any, Any]]) -> bool:
    """Whether two plans' captured calls (`Variant`'s templates) have the same sizes (ints and
    slices) in the same places: an equal plan captured with other sizes (``table[n]``) is
    another variant."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        xs, xspec = flatten_call(tuple(x[0]), dict(x[1]))
        ys, yspec = flatten_call(tuple(y[0]), dict(y[1]))
        if xspec != yspec or len(xs) != len(ys):
            return False
        sized = (i for i, v in enumerate(xs) if _size(v) or _size(ys[i]))
        if not all(_equal(xs[i], ys[i]) for i in sized):
            return False
    return True


def _size(x: Any) -> bool:
    """Whether `x` is a size: an int (not a bool) or a slice."""
    return isinstance(x, slice) or (isinstance(x, int) and not isinstance(x, bool))


def _equal(a: Any, b: Any) -> bool:
    """Whether two sizes (ints, slices) are equal (a slice of tensors: not known, False)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except (RuntimeError, TypeError):
        return False


def _next_is(node: NodePlan, stop: Replan, variant: Variant) -> bool:
    """Whether `node` (of `variant`) is the call `stop` met: its op, on the same parameters
    when known, captured with the call's sizes when it stopped for them."""
    if stop.op is None or node.op != stop.op:
        return False
    if stop.params is not None and not fits(node_reads(node), stop.params):
        return False
    return _same_sizes(variant[1][stop.cursor], stop)


_FLAG_TYPES = (bool, str, type(None))
_MOST_FLAGS = 64  # (flag combinations remembered: the oldest forgotten past it)


def _flags(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A call's flags: its top-level arguments that are not tensors, when all are bools,
    strings or None (positions and names kept); None when another kind is among them (an int
    that changes every call would make a key per call)."""
    named = [*enumerate(args), *sorted(kwargs.items())]
    flags = [(k, v) for k, v in named if not isinstance(v, torch.Tensor)]
    if not all(isinstance(v, _FLAG_TYPES) for _, v in flags):
        return None
    return tuple(flags)


@dataclass
class ByFlags:
    """Flags -> the plan a call with them last ran (see the module docstring)."""

    seen: dict[tuple[Any, ...], Variant] = field(default_factory=dict)

    def pick(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        shapes: dict[str, Any],
        plans: Sequence[Variant],
    ) -> Variant | None:
        """The plan the last call with these flags ran, if it is for inputs of `shapes` and
        still one of `plans` (not one replaced since: other gradient buckets)."""
        key = _flags(args, kwargs)
        found = self.seen.get(key) if key is not None else None
        if found is None or dict(found[0].input_shapes) != shapes:
            return None
        return next((v for v in plans if v[0] is found[0]), None)

    def note(self, args: tuple[Any, ...], kwargs: dict[str, Any], ran: Variant) -> None:
        """A call with these arguments ran `ran` to its end."""
        key = _flags(args, kwargs)
        if key is None:
            return
        self.seen.pop(key, None)
        self.seen[key] = ran
        if len(self.seen) > _MOST_FLAGS:
            self.seen.pop(next(iter(self.seen)))


def keep_few(plans: list[Variant], tables: dict[int, Any], reason: str) -> None:
    """After a new plan was appended to `plans` (for `reason`): warn once when there are more
    than `WARN_PLANS`; drop the oldest but the first past `MOST_PLANS` (and its `tables` entry,
    keyed by the plan's id)."""
    if len(plans) == WARN_PLANS + 1:
        warnings.warn(
            f"AutoParallel: {len(plans)} plans made for this network (the latest because the "
            f"network called {reason}); each new input signature costs a capture and a plan, "
            f"and at most {MOST_PLANS} are kept: pad inputs to a few fixed shapes (bucketed "
            f"sequence lengths, drop_last=True)",
            stacklevel=4,
        )
    while len(plans) > MOST_PLANS:
        dropped, _ = plans.pop(1)
        tables.pop(id(dropped), None)
