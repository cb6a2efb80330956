"""Strategies -> layouts: what a primitive's ``shard(in_strategy)`` means on the devices.

A tuple strategy such as MatMul's ``((2, 4), (4, 1))`` only gives split counts; the primitive's
rule says which device-matrix axis each input dim belongs to (MatMul: x -> axes (0, 1), w -> axes
(1, 2), so the device matrix is ``[a, b, c]``). The steps:

- `strategy_kind`: is a strategy all int tuples or all `TensorLayout`s (never mixed; ``()``, a
  0-d input's entry, fits either)? `scalar_layouts` makes such a ``()`` next to Layout calls
  their ``layout()``.
- `check_int_strategy`: types, values >= 1, one tuple per input, one value per tensor dim.
- `strategy_layouts`: the device matrix (axis sizes from the strategy, the repeat factor appended
  on the right when the product is below the device count) and one `TensorLayout` per input.
- `check_layout_strategy`: the same checks for a strategy of `Layout` calls (one device matrix for
  all inputs, its size == the device count).
- `resolve_strategy`: either kind -> `StrategyLayouts`.

Rule helpers for primitives (`elementwise_axes`, `data_parallel_strategy`) live in `_rules`.

Errors are `ValueError`s (`LayoutTypeError` for wrong types) naming the primitive (`who`), the
input, the dim and what would be valid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple, TypeAlias, TypeVar

from shardwise.layout._core import DeviceMatrix, TensorLayout
from shardwise.layout._layout import LayoutTypeError
from shardwise.layout._rules import elementwise_axes

IntStrategy: TypeAlias = Sequence[Sequence[int]]
AxisMap: TypeAlias = Sequence[Sequence[int | None]]
"""Per input, per tensor dim: the device-matrix axis that splits it, or None (never split)."""
REPEAT = "repeat"
_Entry = TypeVar("_Entry")


class StrategyLayouts(NamedTuple):
    """A primitive's device matrix and one layout per input (unpacks as a pair).

    Example:
        >>> matrix, (x, w) = strategy_layouts(((2, 4), (4, 1)), 8, [[0, 1], [1, 2]])
    """

    matrix: DeviceMatrix
    layouts: tuple[TensorLayout, ...]

    @property
    def repeat(self) -> int:
        """The repeat factor (devices holding the same slices); 1 when none was appended."""
        names = self.matrix.names
        return self.matrix.shape[-1] if names and names[-1] == REPEAT else 1

    def __str__(self) -> str:
        inputs = ", ".join(str(t).split(" on ")[0] for t in self.layouts)
        return f"[{inputs}] on {self.matrix}"


def _input_name(i: int, input_names: Sequence[str] | None) -> str:
    return f"input {i}" if input_names is None else f"input {i} ({input_names[i]})"


def _fmt(strategy: object) -> str:
    """A strategy printed as the user wrote it (tuples, not lists)."""
    if isinstance(strategy, list | tuple):
        inner = ", ".join(_fmt(s) for s in strategy)
        return f"({inner},)" if len(strategy) == 1 else f"({inner})"
    return repr(strategy) if not isinstance(strategy, TensorLayout) else str(strategy)


def strategy_kind(strategy: object, who: str = "primitive") -> Literal["ints", "layouts"]:
    """Whether `strategy` is made of int tuples or of `TensorLayout`s (Layout calls).

    Args:
        strategy: one tuple entry per input.
        who: the primitive, for messages.

    Returns:
        ``"ints"`` or ``"layouts"``.

    Raises:
        ValueError: the two kinds are mixed, or the strategy is empty.
        LayoutTypeError: an entry is neither.

    Example:
        >>> strategy_kind(((2, 4), (4, 1)))
        'ints'
    """
    if not isinstance(strategy, tuple | list) or not strategy:
        raise LayoutTypeError(
            f"{who}: a strategy is a non-empty tuple with one entry per input, got {strategy!r}"
        )
    kinds = set()
    for i, entry in enumerate(strategy):
        if isinstance(entry, TensorLayout):
            kinds.add("layouts")
        elif isinstance(entry, tuple | list):
            if entry:  # (``()``, a 0-d input's entry, fits either kind)
                kinds.add("ints")
        else:
            raise LayoutTypeError(
                f"{who}: strategy entry {i} is {entry!r}; expected a tuple of ints or a "
                f"Layout call such as layout('dp', 'None')"
            )
    if len(kinds) > 1:
        raise ValueError(
            f"{who}: strategy {_fmt(strategy)} mixes int tuples and Layouts; use one kind "
            f"for all inputs (a 0-d input's entry, () or layout(), fits either)"
        )
    return "layouts" if "layouts" in kinds else "ints"


def scalar_layouts(strategy: Sequence[_Entry]) -> tuple[_Entry | TensorLayout, ...]:
    """`strategy` with each ``()`` entry (a 0-d input's) next to Layout calls made the 0-d
    layout of their device matrix (as ``layout()``); unchanged without Layout calls.

    Example:
        >>> layout = Layout((2, 4), ("dp", "mp"))
        >>> scalar_layouts((layout("dp", "mp"), ()))[1] == layout()
        True
    """
    first = next((e for e in strategy if isinstance(e, TensorLayout)), None)
    if first is None:
        return tuple(strategy)
    return tuple(
        TensorLayout(first.matrix, ()) if isinstance(e, tuple | list) and not e else e
        for e in strategy
    )


def check_int_strategy(
    strategy: object,
    ranks: Sequence[int],
    who: str = "primitive",
    input_names: Sequence[str] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Validate an int strategy's structure and return it as a tuple of tuples.

    Args:
        strategy: e.g. ``((2, 4), (4, 1))``.
        ranks: the number of dims of each input.
        who: the primitive, for messages.
        input_names: optional names of the inputs, for messages.

    Returns:
        The strategy as a tuple of int tuples.

    Raises:
        ValueError: wrong number of entries or of values, a value < 1.
        LayoutTypeError: a value that is not an int.

    Example:
        >>> check_int_strategy([[2, 4], [4, 1]], [2, 2])
        ((2, 4), (4, 1))
    """
    strategy_kind(strategy, who)
    assert isinstance(strategy, tuple | list)
    if len(strategy) != len(ranks):
        raise ValueError(
            f"{who}: strategy {_fmt(strategy)} has {len(strategy)} entries but the primitive "
            f"has {len(ranks)} inputs; give one tuple per input"
        )
    out = []
    for i, (entry, rank) in enumerate(zip(strategy, ranks, strict=True)):
        name = _input_name(i, input_names)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in entry):
            raise LayoutTypeError(f"{who}: {name} strategy {_fmt(entry)} must hold ints")
        if len(entry) != rank:
            raise ValueError(
                f"{who}: {name} has {rank} dims but its strategy {_fmt(entry)} has "
                f"{len(entry)} values; give one split count per dim"
            )
        if any(v < 1 for v in entry):
            raise ValueError(f"{who}: {name} strategy {_fmt(entry)}: every value must be >= 1")
        out.append(tuple(entry))
    return tuple(out)


def _axis_sizes(
    strategy: tuple[tuple[int, ...], ...],
    dims_to_axes: AxisMap,
    who: str,
    input_names: Sequence[str] | None,
) -> list[int]:
    """The size of every device-matrix axis, read from the strategy through the rule's map."""
    found: dict[int, tuple[int, int, int]] = {}  # axis -> (size, input, dim) that first set it
    for i, (entry, axes) in enumerate(zip(strategy, dims_to_axes, strict=True)):
        name = _input_name(i, input_names)
        for d, (value, axis) in enumerate(zip(entry, axes, strict=True)):
            if axis is None:
                if value != 1:
                    raise ValueError(
                        f"{who}: {name} dim {d} cannot be split by this primitive "
                        f"(strategy {_fmt(entry)} has {value} there); use 1"
                    )
                continue
            if axis in found and found[axis][0] != value:
                size, j, dj = found[axis]
                raise ValueError(
                    f"{who}: strategy {_fmt(strategy)} splits {name} dim {d} into {value} but "
                    f"{_input_name(j, input_names)} dim {dj} into {size}; these dims share a "
                    f"device axis and must be split alike"
                )
            found.setdefault(axis, (value, i, d))
    count = max(found, default=-1) + 1
    missing = [a for a in range(count) if a not in found]
    if missing:
        raise ValueError(f"{who}: the rule maps no tensor dim to device axes {missing}")
    return [found[a][0] for a in range(count)]


def _check_product(strategy: object, sizes: Sequence[int], device_num: int, who: str) -> None:
    product = math.prod(sizes)
    if device_num < 1:
        raise ValueError(f"{who}: the device count is {device_num}; it must be >= 1")
    if device_num % product:
        valid = [k for k in range(1, device_num + 1) if device_num % k == 0]
        raise ValueError(
            f"{who}: strategy {_fmt(strategy)} uses {product} devices (device matrix "
            f"{list(sizes)}), which does not divide the device count {device_num}; the product "
            f"must be one of {valid} (below {device_num}, the rest become replicas)"
        )


def strategy_layouts(
    strategy: IntStrategy,
    device_num: int,
    dims_to_axes: AxisMap | None = None,
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    who: str = "primitive",
    input_names: Sequence[str] | None = None,
) -> StrategyLayouts:
    """The device matrix and input layouts of a primitive's int strategy.

    Args:
        strategy: one tuple of split counts per input, e.g. MatMul's ``((2, 4), (4, 1))``.
        device_num: devices in the job (or pipeline stage).
        dims_to_axes: the primitive's rule: per input, per dim, the device-matrix axis splitting
            it (dims on one axis must be split alike) or None (never split; value must be 1).
            Default: `elementwise_axes` of the strategy (the strategy itself is the matrix).
        shapes: the inputs' global shapes, to check that every split divides its dim.
        who: the primitive (e.g. its module path), for messages.
        input_names: optional input names, for messages.

    Returns:
        `StrategyLayouts`: a matrix with axes ``d0, d1, ...`` (sizes from the strategy) plus
        ``repeat`` (appended on the right, fastest, when the product is below `device_num`);
        axes of size 1 split nothing.

    Raises:
        ValueError: see `check_int_strategy`; dims on one axis split differently; a product
            that does not divide `device_num`; a split that does not divide a dim of `shapes`.

    Example:
        >>> matrix, (x, w) = strategy_layouts(((2, 4), (4, 1)), 8, [[0, 1], [1, 2]])
        >>> str(matrix), x.dims, w.dims
        ('DeviceMatrix(d0=2, d1=4, d2=1)', ((0,), (1,)), ((1,), ()))
        >>> strategy_layouts(((4, 1),), 8).matrix.shape    # 2 replicas per slice
        (4, 1, 2)
    """
    strategy_kind(strategy, who)
    if dims_to_axes is None:
        lengths = [len(e) if isinstance(e, tuple | list) else 0 for e in strategy]
        dims_to_axes = elementwise_axes(shapes or [[2] * n for n in lengths])
    ranks = [len(a) for a in dims_to_axes]
    checked = check_int_strategy(strategy, ranks, who, input_names)
    sizes = _axis_sizes(checked, dims_to_axes, who, input_names)
    _check_product(strategy, sizes, device_num, who)
    repeat = device_num // math.prod(sizes)
    names = [f"d{k}" for k in range(len(sizes))]
    if repeat > 1 or not sizes:
        sizes, names = [*sizes, repeat], [*names, REPEAT]
    matrix = DeviceMatrix(tuple(sizes), tuple(names))
    layouts = tuple(
        TensorLayout(matrix, tuple(() if a is None or sizes[a] == 1 else (a,) for a in axes))
        for axes in dims_to_axes
    )
    if shapes is not None:
        _check_shapes(layouts, shapes, who, input_names)
    return StrategyLayouts(matrix, layouts)


def _check_shapes(
    layouts: Sequence[TensorLayout],
    shapes: Sequence[Sequence[int]],
    who: str,
    input_names: Sequence[str] | None,
) -> None:
    if len(shapes) != len(layouts):
        raise ValueError(f"{who}: {len(layouts)} layouts for {len(shapes)} input shapes")
    for i, (layout, shape) in enumerate(zip(layouts, shapes, strict=True)):
        layout.check(shape, f"{who}: {_input_name(i, input_names)}")


def check_layout_strategy(
    strategy: Sequence[TensorLayout],
    device_num: int,
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    who: str = "primitive",
    input_names: Sequence[str] | None = None,
) -> StrategyLayouts:
    """Validate a strategy of Layout calls (one `TensorLayout` per input).

    Args:
        strategy: e.g. ``(layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None"))``.
        device_num: devices in the job (or pipeline stage); the matrix must hold exactly these.
        shapes: the inputs' global shapes: the number of dims and every split are checked.
        who: the primitive, for messages.
        input_names: optional input names, for messages.

    Returns:
        `StrategyLayouts` with the common device matrix.

    Raises:
        ValueError: layouts on different device matrices, a matrix whose size is not
            `device_num`, a layout that does not fit its input's shape; mixed kinds.

    Example:
        >>> layout = Layout((2, 4), ("dp", "mp"))
        >>> check_layout_strategy((layout("dp", "mp"), layout("mp", "None")), 8).matrix.shape
        (2, 4)
    """
    if strategy_kind(strategy, who) != "layouts":
        raise LayoutTypeError(f"{who}: expected Layout calls, got {_fmt(strategy)}")
    strategy = [e for e in scalar_layouts(strategy) if isinstance(e, TensorLayout)]
    matrix = strategy[0].matrix
    for i, layout in enumerate(strategy):
        if layout.matrix != matrix:
            raise ValueError(
                f"{who}: {_input_name(i, input_names)} is laid out on {layout.matrix} but "
                f"input 0 on {matrix}; all inputs of one primitive need the same Layout"
            )
    if matrix.size != device_num:
        raise ValueError(
            f"{who}: {matrix} holds {matrix.size} devices but the job has {device_num}; a "
            f"Layout's device matrix must multiply to exactly {device_num}"
        )
    if shapes is not None:
        _check_shapes(strategy, shapes, who, input_names)
    return StrategyLayouts(matrix, tuple(strategy))


def resolve_strategy(
    strategy: IntStrategy | Sequence[TensorLayout],
    device_num: int,
    dims_to_axes: AxisMap | None = None,
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    who: str = "primitive",
    input_names: Sequence[str] | None = None,
) -> StrategyLayouts:
    """`strategy_layouts` for int tuples, `check_layout_strategy` for Layout calls.

    Example:
        >>> resolve_strategy(((8, 1),), 8).layouts[0].dims
        ((0,), ())
    """
    if strategy_kind(strategy, who) == "layouts":
        layouts = [s for s in scalar_layouts(strategy) if isinstance(s, TensorLayout)]
        return check_layout_strategy(
            layouts, device_num, shapes=shapes, who=who, input_names=input_names
        )
    ints = [s for s in strategy if not isinstance(s, TensorLayout)]
    return strategy_layouts(
        ints, device_num, dims_to_axes, shapes=shapes, who=who, input_names=input_names
    )
