"""The base of every shardable primitive: strategies, arguments and names.

- `Primitive`: a `torch.nn.Module` carrying MindSpore's constructor arguments (`init_args`),
  its strategies (`shard`, `in_strategy`, `out_strategy`) and its module path (`who`).
- `normalize_strategy`: the light checks `shard()` does (int tuples of split counts >= 1 or
  Layout calls, never mixed; lists become tuples, a 0-d input's ``()`` next to Layout calls
  their ``layout()``). Everything that needs shapes or the device count waits for plan time
  (`shardwise.ops.rules`).
- `normalize_entry`: the same checks for one tensor's layout (`sw.reshard`, `parameter_plan`).
- `name_primitives`: gives every primitive inside a network its module path, for messages.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from torch import nn

from shardwise.layout import (
    Layout,
    LayoutTypeError,
    TensorLayout,
    scalar_layouts,
    strategy_kind,
)
from shardwise.layout._layout import index_tuple
from shardwise.ops._plan import Strategy
from shardwise.ops._spec_checks import fmt_strategy

REQUIRED = object()
"""Marks a call argument without default (Gather's axis, Reshape's shape, Transpose's perm)."""


def _entry(
    entry: object, where: str, who: str, of_strategy: bool = True
) -> tuple[int, ...] | TensorLayout:
    """One entry checked; `where` names it (``in_strategy entry 1``, ``parameter_plan['w']``),
    `of_strategy` whether it is one of a strategy's entries."""
    if isinstance(entry, TensorLayout):
        return entry
    if isinstance(entry, Layout):
        raise LayoutTypeError(
            f"{who}: {where} is a Layout; call it with one alias per tensor dim, "
            f"e.g. layout('dp', 'None')"
        )
    ints = index_tuple(entry)  # (NumPy integers too)
    if ints is not None:
        for d, v in enumerate(ints):
            if v < 1:
                raise ValueError(
                    f"{who}: {where} {ints!r} splits dim {d} into {v} parts; "
                    f"each value is a number of parts >= 1 (1: not split)"
                )
        return ints
    hint = ""
    if isinstance(entry, int) and of_strategy:
        hint = " (a strategy holds one tuple per input: ((2, 4),) not (2, 4))"
    elif isinstance(entry, str):
        hint = (
            f" (an alias alone is not a layout: name one per dim, e.g. layout({entry!r}, 'None'))"
        )
    raise LayoutTypeError(
        f"{who}: {where} is {entry!r}; expected a tuple of ints or a Layout call{hint}"
    )


def normalize_entry(entry: object, what: str, who: str) -> tuple[int, ...] | TensorLayout:
    """One tensor's layout (`sw.reshard`'s, a `parameter_plan` value): a tuple of split counts
    or a Layout call, checked as a strategy's entries are; `what` names it in messages.

    Raises:
        LayoutTypeError: a wrong type (a `TypeError` that is also a `ValueError`).
        ValueError: a split count below 1.

    Example:
        >>> normalize_entry([4, 1], "parameter_plan['weight']", "sw.shard")
        (4, 1)
    """
    return _entry(entry, what, who, of_strategy=False)


def normalize_strategy(strategy: object, what: str, who: str) -> Strategy | None:
    """Check a `shard()` argument's types and return it as a tuple of tuples / layouts.

    Args:
        strategy: None, or one entry per input: a tuple of ints, or a `TensorLayout`.
        what: ``"in_strategy"`` or ``"out_strategy"``, for messages.
        who: the primitive, for messages.

    Returns:
        None, or the strategy with lists turned into tuples.

    Raises:
        LayoutTypeError: a wrong type (a `TypeError` that is also a `ValueError`).
        ValueError: int tuples and Layouts mixed, or a split count below 1.

    Example:
        >>> normalize_strategy([[2, 4], [4, 1]], "in_strategy", "MatMul")
        ((2, 4), (4, 1))
    """
    if strategy is None:
        return None
    if isinstance(strategy, Layout | TensorLayout) or not isinstance(strategy, tuple | list):
        raise LayoutTypeError(
            f"{who}: {what} must be a tuple with one entry per input (tuples of ints or Layout "
            f"calls), got {strategy!r}"
        )
    if not strategy:
        raise LayoutTypeError(f"{who}: {what} is empty; give one entry per input")
    out = tuple(_entry(e, f"{what} entry {i}", who) for i, e in enumerate(strategy))
    strategy_kind(out, f"{who}: {what}")
    return scalar_layouts(out)


class Primitive(nn.Module):
    """A shardable compute primitive (base class).

    Subclasses set `input_names` (tensor inputs, in call order) and `call_args` (non-tensor
    arguments after them, with defaults), pass their constructor arguments to ``__init__`` and
    implement ``forward`` with torch ops (the single-device result).

    Attributes:
        in_strategy: the strategy given to `shard` (None: the data-parallel default).
        out_strategy: the output strategy given to `shard`, or None.
        module_path: the primitive's name inside its network ("" until `name_primitives`).
    """

    input_names: ClassVar[tuple[str, ...]] = ("x",)
    call_args: ClassVar[tuple[tuple[str, object], ...]] = ()

    def __init__(self, **init_args: Any) -> None:
        super().__init__()
        self._init_args = dict(init_args)
        for key, value in init_args.items():
            setattr(self, key, value)
        self.in_strategy: Strategy | None = None
        self.out_strategy: Strategy | None = None
        self.module_path = ""

    @property
    def name(self) -> str:
        """The primitive's MindSpore name (its class name): the key of its rule in `RULES`."""
        return type(self).__name__

    @property
    def who(self) -> str:
        """How messages name it: ``"net.matmul1 (MatMul)"``, or ``"MatMul"`` before naming."""
        return f"{self.module_path} ({self.name})" if self.module_path else self.name

    def init_args(self) -> dict[str, Any]:
        """The constructor arguments (MindSpore's primitive attributes)."""
        return dict(self._init_args)

    def op_args(self, **call_args: Any) -> dict[str, Any]:
        """``{"op": name, **init_args, **call args}`` for a rule; missing call args take their
        defaults.

        Raises:
            ValueError: an unknown call argument, or a required one missing.
        """
        known = dict(self.call_args)
        unknown = sorted(set(call_args) - set(known))
        if unknown:
            raise ValueError(
                f"{self.who}: unknown call arguments {unknown}; it takes {list(known)}"
            )
        args: dict[str, Any] = {"op": self.name, **self._init_args}
        for key, default in known.items():
            value = call_args.get(key, default)
            if value is REQUIRED:
                raise ValueError(f"{self.who}: planning needs the call argument {key!r}")
            args[key] = value
        return args

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the op; keyword arguments (``ReduceSum()(x, axis=1)``, ``MatMul()(x=h, w=w)``)
        are put in their places first, so that plans and hooks see every argument where
        ``forward`` puts it (they saw positional ones only: a plan took the default axis)."""
        if kwargs:
            args = self._positional(args, kwargs)
        return super().__call__(*args)

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        params = _forward_params(type(self))  # type: ignore[arg-type]
        names = [key for key, _ in params]
        for key in kwargs:
            if key not in names:
                raise TypeError(f"{self.who}: unknown argument {key!r}; it takes {names}")
            if names.index(key) < len(args):
                raise TypeError(f"{self.who}: argument {key!r} given by position and by name")
        defaults = dict(params)
        out = list(args)
        for key in names[len(args) : max(names.index(k) for k in kwargs) + 1]:
            value = kwargs.get(key, defaults.get(key, REQUIRED))
            if value is REQUIRED:
                raise TypeError(f"{self.who}: missing argument {key!r} (it takes {names})")
            out.append(value)
        return tuple(out)

    def split_call(self, *args: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward's positional arguments -> (tensor inputs, non-tensor call arguments)."""
        n = len(self.input_names)
        names = [key for key, _ in self.call_args]
        return tuple(args[:n]), dict(zip(names, args[n:], strict=False))

    def shard(self, in_strategy: object = None, out_strategy: object = None) -> Self:
        """Set the strategies (MindSpore's ``Primitive.shard``); returns self.

        Args:
            in_strategy: one entry per input: a tuple of split counts per dim (``((2, 4), (4,
                1))``), or a Layout call (``(layout("mp", ("sp", "dp")), ...)``); None keeps
                the data-parallel default.
            out_strategy: optional, same kind as `in_strategy` (MatMul / BatchMatMul / Gather:
                ask for a ReduceScatter instead of an AllReduce).

        Returns:
            self, so that ``MatMul().shard(...)`` can be assigned directly.

        Raises:
            LayoutTypeError: wrong types (also a ValueError).
            ValueError: int tuples and Layouts mixed (within or across the two strategies), or
                an out_strategy without an in_strategy.

        Example:
            >>> mm = MatMul().shard(((2, 4), (4, 1)))
        """
        ins = normalize_strategy(in_strategy, "in_strategy", self.who)
        outs = normalize_strategy(out_strategy, "out_strategy", self.who)
        if outs is not None:
            if ins is None:
                raise ValueError(f"{self.who}: out_strategy needs an in_strategy as well")
            if strategy_kind(ins, self.who) != strategy_kind(outs, self.who):
                raise ValueError(
                    f"{self.who}: in_strategy and out_strategy mix int tuples and Layouts; use "
                    f"one kind for both"
                )
        self.in_strategy, self.out_strategy = ins, outs
        return self

    def extra_repr(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self._init_args.items()]
        if self.in_strategy is not None:
            parts.append(f"in_strategy={_show(self.in_strategy)}")
        if self.out_strategy is not None:
            parts.append(f"out_strategy={_show(self.out_strategy)}")
        return ", ".join(parts)


def _show(strategy: Sequence[object]) -> str:
    return fmt_strategy(strategy)


def name_primitives(net: nn.Module, prefix: str = "") -> dict[str, Primitive]:
    """Give every primitive inside `net` its module path (``"matmul1"``, ``"block.attn.qk"``).

    Args:
        net: the network.
        prefix: prepended to every path (``"net"`` -> ``"net.matmul1"``).

    Returns:
        Path -> primitive, in `named_modules` order (a shared primitive keeps its first path).

    Example:
        >>> name_primitives(net, "net")["net.matmul1"].who
        'net.matmul1 (MatMul)'
    """
    found: dict[str, Primitive] = {}
    for path, module in net.named_modules():
        if isinstance(module, Primitive):
            full = ".".join(p for p in (prefix, path) if p) or module.name
            module.module_path = full
            found[full] = module
    return found


@functools.cache
def _forward_params(cls: type[nn.Module]) -> tuple[tuple[str, object], ...]:
    """``forward``'s positional parameters after ``self``: (name, default or `REQUIRED`)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(
        (p.name, REQUIRED if p.default is inspect.Parameter.empty else p.default)
        for p in params
        if p.kind in kinds
    )
