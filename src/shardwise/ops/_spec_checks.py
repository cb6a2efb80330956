"""The strategy checks of `plan_spec` (`shardwise.ops._spec`), and how strategies are written
in their messages.

- `fmt_strategy` / `layout_call`: a strategy, or one Layout, as the user writes it.
- `check_entries` (step 2): ints or Layouts (never mixed), one entry per input, one value per
  dim.
- `check_ties` (step 3): dims on one logical axis split alike; broadcast dims (None) whole (the
  message names every axis split differently and every split broadcast dim).
- `check_fixed` (step 3): dims on a `fixed` logical axis (Softmax's axis, LayerNorm's normalized
  dims, ...) whole.
- `check_disjoint` (step 5): no device axis splits two logical axes.

Each raises a ValueError naming the input and dim. `check_ties` and `check_fixed` list the fixes
of `shardwise.ops._spec_fixes` that plan (at most four; those that repair every refused dim at
once), or say in words what to change where none does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from shardwise.layout import (
    DeviceMatrix,
    TensorLayout,
    check_int_strategy,
    strategy_kind,
)
from shardwise.ops._plan import Shape, Strategy
from shardwise.ops._spec_fixes import (
    Ints,
    Plans,
    fixed_tiers,
    layout_tie_tiers,
    planning,
    replaced,
    tie_tiers,
)

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


def _ints(strategy: Strategy) -> Ints | None:
    """`strategy` if every entry is an int tuple (a fix can be suggested), else None."""
    ints = tuple(e for e in strategy if isinstance(e, tuple))
    return ints if len(ints) == len(strategy) else None


def _listed(tiers: Sequence[Sequence[Strategy]], plans: Plans | None, words: str) -> str:
    """The fixes of `tiers` that plan (`planning`), as a message lists them; else `words`."""
    return " or ".join(fmt_strategy(list(c)) for c in planning(tiers, plans)) or words


def check_ties(
    strategy: Strategy,
    spec: Spec,
    shapes: Sequence[Shape],
    label: str,
    world: int,
    plans: Plans | None = None,
) -> None:
    """Dims on one logical axis split alike; broadcast dims (None) not split. The message names
    every axis split differently and every split broadcast dim; a suggested fix repairs them
    all and plans (`plans`: the op's rule on `world` devices)."""
    first: dict[int, tuple[int, int]] = {}
    clashes: list[Clash] = []
    broadcast: dict[tuple[int, int], int] = {}  # split broadcast dims: fixed to 1
    for i, dims in enumerate(spec.inputs):
        entry = strategy[i]
        for d, lg in enumerate(dims):
            if lg is None:
                if _splits(entry, d) > 1:
                    broadcast[(i, d)] = 1
                continue
            j, e = first.setdefault(lg, (i, d))
            clashed = any(c[0] == lg for c in clashes)
            if not clashed and _key(entry, d) != _key(strategy[j], e):
                clashes.append((lg, (j, e), (i, d)))
    if clashes:
        why = _clash_message(strategy, spec, shapes, world, plans, clashes, broadcast)
        raise ValueError(f"{label}: {why}")
    if broadcast:
        why = _broadcast_message(strategy, spec, shapes, world, plans, broadcast)
        raise ValueError(f"{label}: {why}")


def _broadcast_message(
    strategy: Strategy,
    spec: Spec,
    shapes: Sequence[Shape],
    world: int,
    plans: Plans | None,
    broadcast: Mapping[tuple[int, int], int],
) -> str:
    (i, d), *more = broadcast
    ints = _ints(strategy)
    fix = "'None'"
    if ints is not None:
        words = (
            f"1 for each broadcast dim, with the other splits dividing their dims and their "
            f"product dividing the device count {world}"
        )
        fix = _listed(fixed_tiers(replaced(ints, broadcast), spec, shapes), plans, words)
    also = "".join(
        f", and {_input(spec, k)} dim {dd} (size {shapes[k][dd]}) is broadcast but split"
        for k, dd in more
    )
    return (
        f"{_input(spec, i)} dim {d} (size {shapes[i][d]}) is broadcast and cannot be "
        f"split, but the strategy splits it into {_show(strategy[i], d)}{also}; valid: {fix}"
    )


def _clash_message(
    strategy: Strategy,
    spec: Spec,
    shapes: Sequence[Shape],
    world: int,
    plans: Plans | None,
    clashes: Sequence[Clash],
    broadcast: Mapping[tuple[int, int], int],
) -> str:
    (_, (j, e), (i, d)), *more = clashes
    ints = _ints(strategy)
    if ints is None:
        layouts = [s for s in strategy if isinstance(s, TensorLayout)]
        words = f"the same axes, in the same order, as {_input(spec, j)} dim {e}"
        if more or broadcast:
            words = "each pair named split by the same axes, in the same order"
            words += ", and 'None' for each broadcast dim" if broadcast else ""
        fixes = layout_tie_tiers(layouts, spec, [c[0] for c in clashes], broadcast)
        fix = _listed(fixes, plans, words)
    else:
        tiers = tie_tiers(ints, spec, shapes, [c[0] for c in clashes], broadcast)
        words = (
            f"the same split on both, with the strategy's device matrix dividing the device "
            f"count {world}"
        )
        fix = _listed(tiers, plans, words)
    also = "".join(f", and {_pair(spec, strategy, c, into=True)}" for c in more) + "".join(
        f", and {_input(spec, k)} dim {dd} (size {shapes[k][dd]}) is broadcast but split"
        for k, dd in broadcast
    )
    return (
        f"{_pair(spec, strategy, clashes[0])} must be split alike, but the strategy "
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


def check_fixed(
    strategy: Strategy,
    spec: Spec,
    label: str,
    shapes: Sequence[Shape],
    world: int,
    plans: Plans | None = None,
) -> None:
    """Dims on a `fixed` logical axis must be whole; a suggested fix plans (`plans`: the op's
    rule on `world` devices)."""
    bad = [
        (i, d)
        for i, dims in enumerate(spec.inputs)
        for d, lg in enumerate(dims)
        if lg in spec.fixed and _splits(strategy[i], d) > 1
    ]
    if not bad:
        return
    i, d = bad[0]
    lg = spec.inputs[i][d]
    assert lg is not None
    fix = "'None' for that dim"
    ints = _ints(strategy)
    if ints is not None:
        words = (
            f"1 for that dim, with the other splits dividing their dims and their product "
            f"dividing the device count {world}"
        )
        fix = _listed(fixed_tiers(ints, spec, shapes), plans, words)
    raise ValueError(
        f"{label}: {_input(spec, i)} dim {d} {spec.fixed[lg]} and cannot be split, but the "
        f"strategy splits it into {_show(strategy[i], d)}; valid: {fix}"
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
