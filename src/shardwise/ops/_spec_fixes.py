"""The fixes a strategy message suggests (the ``valid:`` part of the messages of
`shardwise.ops._spec_checks`): candidate int strategies that repair what a check refused, kept
only where the op plans them.

- `tie_tiers`: every logical axis split differently given one split (each of the splits the
  strategy gives it that divides every dim on it), split broadcast dims whole.
- `layout_tie_tiers`: the same for a strategy of Layout calls: every logical axis split
  differently given the device axes of one of its dims.
- `fixed_tiers`: dims on a `fixed` logical axis whole, the split moved onto another logical axis
  where one takes it (`_moved`), else dropped.
- `planning`: the candidates of the first tier of which any plans: the op's own checks (`Plans`,
  the rule itself) run on each candidate, with the suggestions of their own messages off. Only
  error paths call it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING

from shardwise.layout import TensorLayout
from shardwise.ops._plan import Shape, Strategy

if TYPE_CHECKING:
    from shardwise.ops._spec import Spec

Ints = tuple[tuple[int, ...], ...]
Fixes = Mapping[tuple[int, int], int]
"""(input, dim) -> the split count a fix gives it."""

Plans = Callable[[Strategy], object]
"""Plans a strategy for the op, its input shapes and device count (as its rule does, without
out_strategy); raises ValueError (or TypeError) where it cannot."""

SHOWN = 4  # fixes listed at most

_CHECKING: ContextVar[bool] = ContextVar("shardwise_checking_a_fix", default=False)


def replaced(strategy: Ints, fixes: Fixes) -> Ints:
    """`strategy` with some (input, dim) values replaced."""
    return tuple(
        tuple(fixes.get((i, d), v) for d, v in enumerate(e)) for i, e in enumerate(strategy)
    )


def planning(tiers: Sequence[Sequence[Strategy]], plans: Plans | None) -> list[Strategy]:
    """The candidates of the first tier with any that `plans` accepts (at most `SHOWN`, first
    first); none while a candidate is being checked (its message is not read) or without
    `plans`."""
    if plans is None or _CHECKING.get():
        return []
    token = _CHECKING.set(True)
    try:
        for tier in tiers:
            ok = [c for c in dict.fromkeys(tier) if _plans(c, plans)]
            if ok:
                return ok[:SHOWN]
    finally:
        _CHECKING.reset(token)
    return []


def _plans(candidate: Strategy, plans: Plans) -> bool:
    try:
        plans(candidate)
    except (ValueError, TypeError):
        return False
    return True


def _fixed_splits(strategy: Ints, spec: Spec) -> dict[tuple[int, int], int]:
    """The split dims on a `fixed` logical axis, each fixed to 1."""
    return {
        (i, d): 1
        for i, dims in enumerate(spec.inputs)
        for d, lg in enumerate(dims)
        if lg in spec.fixed and strategy[i][d] > 1
    }


def _moved(
    strategy: Ints, spec: Spec, shapes: Sequence[Shape], bad: Fixes
) -> dict[tuple[int, int], int]:
    """`bad`'s fix with the split moved onto another logical axis, split alike in every input
    and dividing (SoftmaxCrossEntropyWithLogits ``((1, 8), (1, 8))`` -> ``((8, 1), (8, 1))``);
    `bad` alone (the split dropped) when none is."""
    n = max(strategy[i][d] for i, d in bad)
    where: dict[int, list[tuple[int, int]]] = {}
    for j, dims in enumerate(spec.inputs):
        for e, lg in enumerate(dims):
            if lg is not None and lg not in spec.fixed:
                where.setdefault(lg, []).append((j, e))
    for lg in spec.inputs[next(iter(bad))[0]]:
        spots = where.get(lg, []) if lg is not None else []
        grown = {(j, e): strategy[j][e] * n for j, e in spots}
        alike = len(set(grown.values())) == 1
        if spots and alike and all(shapes[j][e] % k == 0 for (j, e), k in grown.items()):
            return {**bad, **grown}
    return dict(bad)


def fixed_tiers(strategy: Ints, spec: Spec, shapes: Sequence[Shape]) -> list[list[Ints]]:
    """`strategy` with its `fixed` dims whole: the split moved (`_moved`), else dropped."""
    bad = _fixed_splits(strategy, spec)
    if not bad:
        return [[strategy]]
    return [[replaced(strategy, _moved(strategy, spec, shapes, bad))], [replaced(strategy, bad)]]


def tie_tiers(
    strategy: Ints,
    spec: Spec,
    shapes: Sequence[Shape],
    clashing: Sequence[int],
    broadcast: Fixes,
) -> list[list[Ints]]:
    """Int strategies with every `clashing` logical axis split alike (each taking one of the
    splits the strategy gives it that divides every dim on it, first-seen first; else 1) and
    the split `broadcast` dims whole; each with its `fixed` dims whole (`fixed_tiers`)."""
    choices = []
    for lg in clashing:
        on_axis = [
            (k, dd)
            for k, dims in enumerate(spec.inputs)
            for dd, axis in enumerate(dims)
            if axis == lg
        ]
        seen = dict.fromkeys(strategy[k][dd] for k, dd in on_axis)
        values = [v for v in seen if all(shapes[k][dd] % v == 0 for k, dd in on_axis)] or [1]
        choices.append([dict.fromkeys(on_axis, v) for v in values])
    tiers: list[list[Ints]] = [[], []]
    for combo in itertools.product(*choices):
        fixed = dict(broadcast)
        for part in combo:
            fixed.update(part)
        for k, tier in enumerate(fixed_tiers(replaced(strategy, fixed), spec, shapes)):
            tiers[k].extend(tier)
    return tiers


def _on_axis(spec: Spec, lg: int) -> list[tuple[int, int]]:
    """The (input, dim) pairs on logical axis `lg`."""
    return [
        (k, dd) for k, dims in enumerate(spec.inputs) for dd, axis in enumerate(dims) if axis == lg
    ]


def layout_tie_tiers(
    strategy: Sequence[TensorLayout],
    spec: Spec,
    clashing: Sequence[int],
    broadcast: Fixes,
) -> list[list[Strategy]]:
    """Layout strategies with every `clashing` logical axis split alike (each taking the device
    axes of one of its dims, first-seen first; axes of size 1 aside, as the check compares them)
    and the split `broadcast` dims whole. A choice that puts one device axis on two dims of an
    input is left out."""
    choices = []
    for lg in clashing:
        on_axis = _on_axis(spec, lg)
        seen: dict[tuple[int, ...], tuple[int, ...]] = {}
        for k, dd in on_axis:
            layout = strategy[k]
            real = tuple(a for a in layout.dims[dd] if layout.matrix.shape[a] > 1)
            seen.setdefault(real, layout.dims[dd])
        choices.append([dict.fromkeys(on_axis, axes) for axes in seen.values()])
    tier: list[Strategy] = []
    for combo in itertools.product(*choices):
        fixes: dict[tuple[int, int], tuple[int, ...]] = dict.fromkeys(broadcast, ())
        for part in combo:
            fixes.update(part)
        try:
            tier.append(
                tuple(
                    TensorLayout(
                        e.matrix, tuple(fixes.get((i, d), a) for d, a in enumerate(e.dims))
                    )
                    for i, e in enumerate(strategy)
                )
            )
        except ValueError:  # one device axis on two dims of an input
            continue
    return [tier]
