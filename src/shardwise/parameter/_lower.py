"""What a recorded entry does to one tensor, as steps that can run on a block of it.

A tensor (a "root" of the tape) can be generated block-wise when every entry that touches it
is one of these steps; `lower` turns one recorded entry into its steps, or says why it cannot:

- `Create`: the factory that made the tensor (``torch.empty``, ``zeros``, ``ones``, ``full``;
  ``rand`` / ``randn`` are ``empty`` and a `Draw`).
- `Draw` / `TruncNormal` (``_chunked``): a random fill of the whole tensor: ``Tensor.uniform_``
  / ``normal_`` and the ``torch.nn.init`` functions made of them (``uniform_``, ``normal_``,
  ``kaiming_uniform_``, ``kaiming_normal_``, ``xavier_uniform_``, ``xavier_normal_``), and
  ``trunc_normal_``.
- `Pointwise`: an in-place op whose arguments are plain numbers and whose result at each element
  depends on that element only (``fill_``, ``zero_``, ``mul_``, ``add_``, ``sub_``, ``div_``,
  ``clamp_``; ``nn.init.zeros_`` / ``ones_`` / ``constant_``), on the tensor or on a view of it
  that is a box (``weight[padding_idx].fill_(0)``).
- `Derive` (`derivation`): the tensor is computed from one other tensor alone by exact
  elementwise arithmetic with numbers or a dtype cast (``torch.randn(n, d) * 0.02``,
  ``.double()``); the other tensor then lives as the same block.

The ``torch.nn.init`` functions are lowered by running them on a `_Probe`: an object that
answers their shape questions (``dim``, ``size``, ``shape``, ``numel``) and records the fills
they call, so their bounds and standard deviations are computed by torch's own code. Anything
else they touch raises, and the tensor is generated whole.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.parameter._box import Box, box_of_view, contiguous_strides
from shardwise.parameter._chunked import Draw, TruncNormal
from shardwise.parameter._tape import RecordedOp, TensorRef, iter_tensors


class Unsupported(Exception):
    """An entry that cannot run on a block (the message says why)."""


@dataclass(frozen=True)
class Create:
    """The tensor's factory: uninitialized (``value`` None) or filled with ``value``."""

    value: float | int | bool | None


@dataclass(frozen=True)
class Pointwise:
    """``view.<name>(*args, **kwargs)`` on the elements of ``box`` (numbers only as args)."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    box: Box


@dataclass(frozen=True)
class Derive:
    """The tensor is ``func(*args, **kwargs)`` of root ``source`` (elementwise, exact: scalar
    arithmetic and dtype casts), computed on ``source``'s block (`SOURCE` marks it in args)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    source: int

    def apply(self, block: torch.Tensor) -> torch.Tensor:
        """The derived block from ``source``'s block."""
        args = tuple(block if a is SOURCE else a for a in self.args)
        kwargs = {k: block if v is SOURCE else v for k, v in self.kwargs.items()}
        out: torch.Tensor = self.func(*args, **kwargs)
        return out.contiguous()


SOURCE = object()
"""Stands for the source block in `Derive.args`."""

Step = Create | Draw | TruncNormal | Pointwise | Derive

_POINTWISE = ("fill_", "zero_", "mul_", "add_", "sub_", "div_", "clamp_")
_INIT_NAMES = (
    "uniform_",
    "normal_",
    "constant_",
    "ones_",
    "zeros_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)
_DERIVING = frozenset(
    {
        *("mul", "add", "sub", "div", "neg", "clone", "to", "float", "double", "half", "bfloat16"),
        *("__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__", "__neg__"),
        *("__truediv__", "__rtruediv__", "__rdiv__"),
    }
)
_FACTORY_VALUES: dict[Callable[..., Any], float | None] = {
    torch.empty: None,
    torch.rand: None,
    torch.randn: None,
    torch.zeros: 0,
    torch.ones: 1,
    torch.full: None,
}
_FACTORY_KWARGS = frozenset({"dtype", "device", "layout", "memory_format", "generator"})


def _generator(value: Any) -> torch.Generator | None:
    if value is None or (isinstance(value, torch.Generator) and value.device.type == "cpu"):
        return value
    raise Unsupported(f"a generator on {getattr(value, 'device', value)}")


def _number(value: Any) -> Any:
    if isinstance(value, numbers.Number) and not isinstance(value, torch.Tensor):
        return value
    raise Unsupported(f"a {type(value).__name__} argument")


def _params(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: tuple[str, str],
    defaults: tuple[float, float],
) -> tuple[float, float, torch.Generator | None]:
    extra = set(kwargs) - {*names, "generator"}
    if len(args) > 2 or extra:
        raise Unsupported(f"arguments {sorted(extra) or args}")
    values = [
        args[i] if i < len(args) else kwargs.get(n, d)
        for i, (n, d) in enumerate(zip(names, defaults, strict=True))
    ]
    return float(_number(values[0])), float(_number(values[1])), _generator(kwargs.get("generator"))


class _Probe:
    """Stands for the tensor a ``torch.nn.init`` function fills; records what it calls."""

    def __init__(self, size: tuple[int, ...], box: Box, exact: bool) -> None:
        self.shape = torch.Size(size)
        self.box = box
        self.exact = exact  # the tensor itself, not a view: its draws follow the whole's order
        self.steps: list[Step] = []

    def dim(self) -> int:
        return len(self.shape)

    ndimension = dim

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def _draw(self, step: Draw) -> _Probe:
        if not self.exact:
            raise Unsupported("a random fill of a view")
        self.steps.append(step)
        return self

    def uniform_(self, *args: Any, **kwargs: Any) -> _Probe:
        return self._draw(Draw("uniform", *_params(args, kwargs, ("from", "to"), (0.0, 1.0))))

    def normal_(self, *args: Any, **kwargs: Any) -> _Probe:
        return self._draw(Draw("normal", *_params(args, kwargs, ("mean", "std"), (0.0, 1.0))))

    def pointwise(self, name: str, *args: Any, **kwargs: Any) -> _Probe:
        for value in [*args, *kwargs.values()]:
            if value is not None:
                _number(value)
        self.steps.append(Pointwise(name, args, kwargs, self.box))
        return self

    def fill_(self, value: Any) -> _Probe:
        return self.pointwise("fill_", value)

    def zero_(self) -> _Probe:
        return self.pointwise("zero_")


def _unwrapped(func: Callable[..., Any]) -> Callable[..., Any]:
    inner: Callable[..., Any] = getattr(func, "__wrapped__", func)
    return inner


def _init_function(func: Callable[..., Any]) -> str | None:
    target = _unwrapped(func)
    for name in (*_INIT_NAMES, "trunc_normal_"):
        if _unwrapped(getattr(torch.nn.init, name)) is target:
            return name
    return None


def _swap(value: Any, probe: _Probe) -> Any:
    if isinstance(value, TensorRef):
        return probe
    if type(value) is tuple or type(value) is list:
        return type(value)(_swap(item, probe) for item in value)
    if type(value) is dict:
        return {k: _swap(item, probe) for k, item in value.items()}
    return value


def _trunc_normal(op: RecordedOp) -> TruncNormal:
    func = _unwrapped(torch.nn.init.trunc_normal_)
    bound = inspect.signature(func).bind(*op.args, **op.kwargs)
    bound.apply_defaults()
    p = dict(bound.arguments)
    mean, std, a, b = (float(_number(p[k])) for k in ("mean", "std", "a", "b"))
    if mean < a - 2 * std or mean > b + 2 * std:
        raise Unsupported("trunc_normal_ with the mean more than 2 std outside [a, b]")

    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    if cdf((b - mean) / std) - cdf((a - mean) / std) <= 0.3:
        raise Unsupported("trunc_normal_ with 30% of the mass or less in [a, b]")
    return TruncNormal(mean, std, a, b, _generator(p["generator"]))


def _mutation(op: RecordedOp, ref: TensorRef, root: TensorRef) -> list[Step]:
    box = box_of_view(ref.size, ref.stride, ref.offset, root.size)
    if box is None or ref.dtype != root.dtype:
        raise Unsupported("an op on a view that is not a box of the tensor")
    name = _init_function(op.func)
    if name == "trunc_normal_":
        if ref != root:
            raise Unsupported("a random fill of a view")
        return [_trunc_normal(op)]
    probe = _Probe(ref.size, box, exact=ref == root)
    args: tuple[Any, ...] = _swap(op.args, probe)
    kwargs: dict[str, Any] = _swap(op.kwargs, probe)
    if name is not None:
        _unwrapped(op.func)(*args, **kwargs)
        return probe.steps
    method = getattr(op.func, "__name__", "")
    steps = probe.steps
    if getattr(torch.Tensor, method, None) is not op.func or not args or args[0] is not probe:
        raise Unsupported(f"{method or op.func} is not a supported in-place op")
    if method in ("uniform_", "normal_"):
        getattr(probe, method)(*args[1:], **kwargs)
    elif method in _POINTWISE:
        probe.pointwise(method, *args[1:], **kwargs)
    else:
        raise Unsupported(f"{method} is not a supported in-place op")
    return steps


def _create(op: RecordedOp, root: TensorRef) -> list[Step]:
    func = op.func
    if func not in _FACTORY_VALUES or len(op.outputs) != 1:
        raise Unsupported(f"made by {getattr(func, '__name__', func)}")
    kwargs = {k: v for k, v in op.kwargs.items() if v is not None}
    if set(kwargs) - _FACTORY_KWARGS - ({"fill_value"} if func is torch.full else set()):
        raise Unsupported(f"a factory with arguments {sorted(kwargs)}")
    if (
        kwargs.get("layout", torch.strided) != torch.strided
        or kwargs.get("memory_format", torch.contiguous_format) != torch.contiguous_format
    ):
        raise Unsupported("a factory with a layout or memory format")
    if root.stride != contiguous_strides(root.size) or root.offset:
        raise Unsupported("a non-contiguous tensor")
    value = _FACTORY_VALUES[func]
    if func is torch.full:
        value = _number(op.args[1] if len(op.args) > 1 else kwargs.get("fill_value"))
    steps: list[Step] = [Create(value)]
    generator = _generator(kwargs.get("generator"))
    if func is torch.rand:
        steps.append(Draw("uniform", 0.0, 1.0, generator))
    elif func is torch.randn:
        steps.append(Draw("normal", 0.0, 1.0, generator))
    return steps


def lower(op: RecordedOp, root: TensorRef) -> list[Step]:
    """The steps ``op`` performs on ``root`` (the root's own layout), which ``op`` creates or
    mutates and which is the only tensor it touches.

    Raises:
        Unsupported: ``op`` cannot run on a block of ``root`` (the message says why).
    """
    if any(True for _ in iter_tensors((op.args, op.kwargs))):
        raise Unsupported(f"{getattr(op.func, '__name__', op.func)} takes a tensor argument")
    if op.outputs:
        return _create(op, root)
    refs = refs_of((op.args, op.kwargs))
    if len(refs) != 1:
        raise Unsupported(f"{getattr(op.func, '__name__', op.func)} touches it twice")
    try:
        return _mutation(op, refs[0], root)
    except Unsupported:
        raise
    except (AttributeError, TypeError, ValueError, IndexError) as error:
        raise Unsupported(f"{getattr(op.func, '__name__', op.func)}: {error}") from error


def refs_of(value: Any) -> list[TensorRef]:
    """Every `TensorRef` inside nested tuples, lists and dicts."""
    if isinstance(value, TensorRef):
        return [value]
    if isinstance(value, tuple | list):
        return [r for item in value for r in refs_of(item)]
    if isinstance(value, dict):
        return [r for item in value.values() for r in refs_of(item)]
    return []


def derivation(op: RecordedOp, source: TensorRef, made: TensorRef) -> Derive:
    """``op`` computing root ``made`` from root ``source`` alone, elementwise, as a `Derive`.

    Raises:
        Unsupported: ``op`` is not one of the exact elementwise ops with plain arguments.
    """
    name = getattr(op.func, "__name__", "")
    known = op.func in (getattr(torch.Tensor, name, None), getattr(torch, name, None))
    if name not in _DERIVING or not known:
        raise Unsupported(f"{name or op.func} computes it from another tensor")
    if made.size != source.size or made.stride != source.stride or made.offset:
        raise Unsupported(f"{name} changes the layout of the tensor it is computed from")
    plain = TensorRef | numbers.Number | torch.dtype | None
    if not all(isinstance(v, plain) for v in (*op.args, *op.kwargs.values())):
        raise Unsupported(f"{name} with arguments other than numbers and dtypes")
    args = tuple(SOURCE if isinstance(a, TensorRef) else a for a in op.args)
    kwargs = {k: SOURCE if isinstance(v, TensorRef) else v for k, v in op.kwargs.items()}
    return Derive(op.func, args, kwargs, source.key)
