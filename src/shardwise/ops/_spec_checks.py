"""The strategy checks of `plan_spec` (`shardwise.ops._spec`), and how strategies are written
in their messages.

- `fmt_strategy` / `layout_call`: a strategy, or one Layout, as the user writes it.
- `check_entries` (step 2): ints or Layouts (never mixed), one entry per input, one value per
  dim.
- `check_ties` (step 3): dims on one logical axis split alike; broadcast dims (None) whole (a
  suggested fix repairs every axis split differently at once: `_tie_fixes`).
- `check_fixed` (step 3): dims on a `fixed` logical axis (Softmax's axis, LayerNorm's normalized
  dims, ...) whole.
- `check_disjoint` (step 5): no device axis splits two logical axes.

Each raises a ValueError naming the input and dim, with a valid strategy where one can be
suggested (`_with`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from shardwise.layout import (
    DeviceMatrix,
    TensorLayout,
    check_int_strategy,
    strategy_kind,
    strategy_layouts,
)
from shardwise.ops._plan import Shape, Strategy

if TYPE_CHECKING:
    from shardwise.ops._spec import Spec


def fmt_strategy(strategy: Sequence[object]) -> str:
    """A strategy as the user writes it: ``((2, 4), (4, 1))`` or ``(layout('dp', 'None'),)``."""

    def one(entry: object) -> str:
        if isinstance(entry, TensorLayout):
            return layout_call(entry)
        values = list(entry) if isinstance(entry, tuple | list) else [entry]
        return "(" + ", ".join(str(v) for v in values) + ("," if len(values) == 1 else "") + ")"

    inner = ", ".join(one(e) for e in strategy)
    return f"({inner},)" if len(strategy) == 1 else f"({inner})"


def layout_call(layout: TensorLayout) -> str:
    """``layout('mp', ('sp', 'dp'))``: how to write `layout` as a Layout call."""
    names = layout.matrix.names

    def one(axes: tuple[int, ...]) -> str:
        if not axes:
            return "'None'"
        if len(axes) == 1:
            return repr(names[axes[0]])
        return "(" + ", ".join(repr(names[a]) for a in axes) + ")"

    return "layout(" + ", ".join(one(a) for a in layout.dims) + ")"


def _input(spec: Spec, i: int) -> str:
    return f"input {i} ({spec.input_names[i]})"


def _splits(entry: tuple[int, ...] | TensorLayout, d: int) -> int:
    return entry.split_count(d) if isinstance(entry, TensorLayout) else entry[d]


def _key(entry: tuple[int, ...] | TensorLayout, d: int) -> object:
    """What must agree between dims on one logical axis: the count, or the (non-trivial) axes."""
    if isinstance(entry, TensorLayout):
        return tuple(entry.matrix.names[a] for a in entry.dims[d] if entry.matrix.shape[a] > 1)
    return entry[d]


def _show(entry: tuple[int, ...] | TensorLayout, d: int) -> str:
    if isinstance(entry, TensorLayout):
        axes = [entry.matrix.names[a] for a in entry.dims[d]]
        return f"{entry.split_count(d)} (axes {', '.join(axes) or 'None'})"
    return str(entry[d])


def _replaced(strategy: Strategy, fixes: Mapping[tuple[int, int], int]) -> Strategy:
    """The int strategy with some (input, dim) values replaced."""
    return tuple(
        tuple(fixes.get((i, d), v) for d, v in enumerate(e)) if isinstance(e, tuple) else e
        for i, e in enumerate(strategy)
    )


def _with(strategy: Strategy, fixes: Mapping[tuple[int, int], int]) -> str:
    """The int strategy with some (input, dim) values replaced, as a suggestion."""
    return fmt_strategy(list(_replaced(strategy, fixes)))


def _fits(strategy: Strategy, spec: Spec, shapes: Sequence[Shape], world: int | None) -> bool:
    """Whether the int `strategy`'s device matrix fits `world` devices (None: any count)."""
    if world is None:
        return True
    ints = [e for e in strategy if isinstance(e, tuple)]
    try:
        strategy_layouts(ints, world, spec.inputs, shapes=shapes)
    except ValueError:
        return False
    return True


def _count(n: int, noun: str) -> str:
    plural = "entries" if noun == "entry" else noun + "s"
    return f"{n} {noun if n == 1 else plural}"


def check_entries(strategy: Strategy, spec: Spec, shapes: Sequence[Shape], label: str) -> str:
    """Kind, entry count and per-input length; returns ``"ints"`` or ``"layouts"``."""
    kind = strategy_kind(strategy, label)
    names = ", ".join(spec.input_names)
    if len(strategy) != len(spec.inputs):
        raise ValueError(
            f"{label}: strategy {fmt_strategy(strategy)} has {_count(len(strategy), 'entry')} "
            f"but {spec.op} has {_count(len(spec.inputs), 'input')} ({names}); give one entry "
            f"per input"
        )
    ranks = [len(s) for s in shapes]
    if kind == "ints":
        check_int_strategy(strategy, ranks, label, spec.input_names)
        return kind
    matrix = strategy[0].matrix if isinstance(strategy[0], TensorLayout) else None
    for i, (entry, shape) in enumerate(zip(strategy, shapes, strict=True)):
        assert isinstance(entry, TensorLayout)
        if entry.matrix != matrix:
            raise ValueError(
                f"{label}: {_input(spec, i)} is laid out on {entry.matrix} but input 0 on "
                f"{matrix}; all inputs of one primitive need the same Layout"
            )
        if entry.ndim != len(shape):
            raise ValueError(
                f"{label}: {_input(spec, i)} has {len(shape)} dims (shape {list(shape)}) but its "
                f"layout {layout_call(entry)} has {entry.ndim}; give one alias or 'None' per dim"
            )
    return kind


Clash = tuple[int, tuple[int, int], tuple[int, int]]
"""Two dims on one logical axis split differently: (axis, its first (input, dim), (input, dim))."""


def check_ties(
    strategy: Strategy, spec: Spec, shapes: Sequence[Shape], label: str, world: int | None = None
) -> None:
    """Dims on one logical axis split alike; broadcast dims (None) not split. The message names
    every axis split differently, and a suggested fix repairs them all and fits `world` devices
    (None: any count)."""
    first: dict[int, tuple[int, int]] = {}
    clashes: list[Clash] = []
    broadcast: dict[tuple[int, int], int] = {}  # split broadcast dims after a clash: fixed to 1
    for i, dims in enumerate(spec.inputs):
        entry = strategy[i]
        for d, lg in enumerate(dims):
            if lg is None:
                if _splits(entry, d) > 1 and clashes:
                    broadcast[(i, d)] = 1
                elif _splits(entry, d) > 1:
                    fix = _with(strategy, {(i, d): 1}) if isinstance(entry, tuple) else "'None'"
                    raise ValueError(
                        f"{label}: {_input(spec, i)} dim {d} (size {shapes[i][d]}) is broadcast "
                        f"and cannot be split, but the strategy splits it into "
                        f"{_show(entry, d)}; valid: {fix}"
                    )
                continue
            j, e = first.setdefault(lg, (i, d))
            clashed = any(c[0] == lg for c in clashes)
            if not clashed and _key(entry, d) != _key(strategy[j], e):
                clashes.append((lg, (j, e), (i, d)))
    if not clashes:
        return
    (lg, (j, e), (i, d)), *more = clashes
    fix = f"the same axes, in the same order, as {_input(spec, j)} dim {e}"
    if all(isinstance(x, tuple) for x in strategy):
        fix = _tie_fixes(strategy, spec, shapes, world, clashes, broadcast)
    also = "".join(f", and {_pair(spec, strategy, c, into=True)}" for c in more) + "".join(
        f", and {_input(spec, k)} dim {dd} (size {shapes[k][dd]}) is broadcast but split"
        for k, dd in broadcast
    )
    raise ValueError(
        f"{label}: {_pair(spec, strategy, clashes[0])} must be split alike, but the strategy "
        f"splits them into {_show(strategy[j], e)} and {_show(strategy[i], d)}{also}; valid: {fix}"
    )


def _pair(spec: Spec, strategy: Strategy, clash: Clash, into: bool = False) -> str:
    """``input 0 (x) dim 1 and input 1 (w) dim 0 (the contracted dim K)`` (`into`: with the two
    splits, ``... into 4 and 2``)."""
    lg, (j, e), (i, d) = clash
    role = f" ({spec.roles[lg]})" if lg in spec.roles else ""
    text = f"{_input(spec, j)} dim {e} and {_input(spec, i)} dim {d}{role}"
    if into:
        text += f" into {_show(strategy[j], e)} and {_show(strategy[i], d)}"
    return text


_SHOWN = 4  # fixes listed at most (every combination of the clashing axes' splits may fit)


def _tie_fixes(
    strategy: Strategy,
    spec: Spec,
    shapes: Sequence[Shape],
    world: int | None,
    clashes: Sequence[Clash],
    broadcast: Mapping[tuple[int, int], int],
) -> str:
    """Int strategies with every clashing axis split alike (each taking one of the splits the
    strategy gives it that divides every dim on it, first-seen first; else 1) and split
    broadcast dims whole, whose device matrix fits `world` (the first `_SHOWN`); else what a
    fix needs."""
    choices = []
    for lg, _, _ in clashes:
        on_axis = [
            (k, dd)
            for k, dims in enumerate(spec.inputs)
            for dd, axis in enumerate(dims)
            if axis == lg
        ]
        seen = dict.fromkeys(_splits(strategy[k], dd) for k, dd in on_axis)
        values = [v for v in seen if all(shapes[k][dd] % v == 0 for k, dd in on_axis)] or [1]
        choices.append([dict.fromkeys(on_axis, v) for v in values])
    fixes = []
    for combo in itertools.product(*choices):
        fixed = dict(broadcast)
        for part in combo:
            fixed.update(part)
        if _fits(_replaced(strategy, fixed), spec, shapes, world):
            fixes.append(_with(strategy, fixed))
    return " or ".join(list(dict.fromkeys(fixes))[:_SHOWN]) or (
        f"the same split on both, with the strategy's device matrix dividing the device count "
        f"{world}"
    )


def _moved(
    strategy: Strategy, spec: Spec, shapes: Sequence[Shape], bad: Mapping[tuple[int, int], int]
) -> dict[tuple[int, int], int]:
    """`bad`'s fix with the split moved onto another logical axis, split alike in every input
    and dividing (SoftmaxCrossEntropyWithLogits ``((1, 8), (1, 8))`` -> ``((8, 1), (8, 1))``);
    `bad` alone (the split dropped) when none is."""
    n = max(_splits(strategy[i], d) for i, d in bad)
    where: dict[int, list[tuple[int, int]]] = {}
    for j, dims in enumerate(spec.inputs):
        for e, lg in enumerate(dims):
            if lg is not None and lg not in spec.fixed:
                where.setdefault(lg, []).append((j, e))
    for lg in spec.inputs[next(iter(bad))[0]]:
        spots = where.get(lg, []) if lg is not None else []
        grown = {(j, e): _splits(strategy[j], e) * n for j, e in spots}
        alike = len(set(grown.values())) == 1
        if spots and alike and all(shapes[j][e] % k == 0 for (j, e), k in grown.items()):
            return {**bad, **grown}
    return dict(bad)


def check_fixed(strategy: Strategy, spec: Spec, label: str, shapes: Sequence[Shape]) -> None:
    """Dims on a `fixed` logical axis must be whole."""
    bad = {
        (i, d): 1
        for i, dims in enumerate(spec.inputs)
        for d, lg in enumerate(dims)
        if lg in spec.fixed and _splits(strategy[i], d) > 1
    }
    if not bad:
        return
    i, d = next(iter(bad))
    entry = strategy[i]
    lg = spec.inputs[i][d]
    assert lg is not None
    fix = (
        _with(strategy, _moved(strategy, spec, shapes, bad))
        if isinstance(entry, tuple)
        else ("'None' for that dim")
    )
    raise ValueError(
        f"{label}: {_input(spec, i)} dim {d} {spec.fixed[lg]} and cannot be split, but the "
        f"strategy splits it into {_show(entry, d)}; valid: {fix}"
    )


def _where(spec: Spec, lg: int) -> str:
    for i, dims in enumerate(spec.inputs):
        if lg in dims:
            role = f" ({spec.roles[lg]})" if lg in spec.roles else ""
            return f"{_input(spec, i)} dim {dims.index(lg)}{role}"
    return f"logical axis {lg}"


def check_disjoint(
    axes: Mapping[int, tuple[int, ...]], matrix: DeviceMatrix, spec: Spec, label: str
) -> None:
    owner: dict[int, int] = {}
    for lg, device_axes in sorted(axes.items()):
        for a in device_axes:
            if matrix.shape[a] > 1 and owner.setdefault(a, lg) != lg:
                raise ValueError(
                    f"{label}: device axis {matrix.names[a]!r} splits both "
                    f"{_where(spec, owner[a])} and {_where(spec, lg)}; one device axis can split "
                    f"only one of the op's dims; use another axis or 'None' for one of them"
                )
