"""Unannotated torch ops run data parallel (MindSpore semi_auto semantics).

`DataParallelOps` is a `TorchFunctionMode` active during a wrapped call. A torch function that
touches no tracked tensor (`Tracker`) runs unchanged (the optimizer, constants, meta tracing).
One that does is looked up in `OP_KINDS`, the table of supported op kinds:

- ``elementwise`` (broadcasting ``+ - * /``, activations): every input with the output's rank
  and a dim 0 larger than 1 is brought to the data-parallel layout (``"dp"``: dim 0 split over
  all ranks), the others (biases, scalars, reduced values) stay whole; the result is ``"dp"``.
- ``rowwise`` / ``linear`` (view / reshape / flatten keeping dim 0, softmax off dim 0,
  ``F.linear``): the first tensor becomes ``"dp"``, every other tensor (weights) must be whole.
- ``loss`` (cross entropy, nll, mse, l1): input and target become ``"dp"``; ``"mean"`` /
  ``"sum"`` losses become one replicated value (local loss, AllReduce(sum), / world size for
  the mean: equal local batch sizes), ``"none"`` stays ``"dp"``.
- ``reduce`` (``sum`` / ``mean``): over all dims or dims containing 0 as the losses; over other
  dims row-wise.

A tracked input whose state is ``"rep"`` everywhere (e.g. a ``full_batch`` input) runs whole on
every rank. Metadata reads (``shape``, ``size()``, ``backward()``, ...) pass; anything else on a
tracked tensor raises `UnsupportedParallelError` naming the op.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardwise import communication as comm
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._runtime import data_parallel_layout, replicated_layout
from shardwise.parallel._tracker import Shape, State, Tracker, check_rank_order
from shardwise.redistribution import redistribute

T = torch.Tensor
_ELEMENTWISE: list[Callable[..., Any]] = [
    T.add, T.__add__, T.__radd__, T.sub, T.__sub__, T.__rsub__, T.mul, T.__mul__, T.__rmul__,
    T.div, T.__truediv__, T.__rtruediv__, T.neg, T.__neg__, torch.add, torch.sub, torch.mul,
    torch.div, torch.neg, torch.relu, T.relu, F.relu, F.gelu, F.silu, torch.sigmoid, T.sigmoid,
    torch.tanh, T.tanh, torch.exp, T.exp,
]  # fmt: skip
_ROWWISE: list[Callable[..., Any]] = [
    T.view, T.reshape, torch.reshape, T.flatten, torch.flatten, F.softmax, F.log_softmax,
    T.softmax, T.log_softmax, torch.softmax, torch.log_softmax, T.detach, T.contiguous, T.clone,
]  # fmt: skip
_SOFTMAX = {F.softmax, F.log_softmax, T.softmax, T.log_softmax, torch.softmax, torch.log_softmax}
_LOSSES: list[Callable[..., Any]] = [F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss]
_REDUCE: list[Callable[..., Any]] = [torch.sum, T.sum, torch.mean, T.mean]

OP_KINDS: dict[Callable[..., Any], str] = {
    **{f: "elementwise" for f in _ELEMENTWISE},
    **{f: "rowwise" for f in _ROWWISE},
    F.linear: "linear",
    **{f: "loss" for f in _LOSSES},
    **{f: "reduce" for f in _REDUCE},
}
"""The supported torch ops on tracked tensors and their kind (see the module docstring)."""

_METADATA = {T.size, T.dim, T.ndimension, T.is_contiguous, T.is_floating_point, T.backward}
_VALUE_READS = {T.item, T.tolist, T.__float__, T.__format__, T.__repr__, T.__bool__}


def op_name(func: Callable[..., Any]) -> str:
    module = getattr(func, "__module__", None) or "torch.Tensor"
    return f"{module}.{getattr(func, '__name__', repr(func))}"


def _is_metadata(func: Callable[..., Any]) -> bool:
    """Shape / dtype queries, attribute reads and writes, ``backward``."""
    return func in _METADATA or getattr(func, "__name__", "") in ("__get__", "__set__")


class DataParallelOps(TorchFunctionMode):
    """Runs the ops of `OP_KINDS` on tracked tensors data parallel (see the module docstring).

    `paused` > 0 lets everything through (set while a primitive or the planner runs).
    `sharded`: ids of parameters cut to blocks, refused as whole inputs.
    """

    def __init__(self, tracker: Tracker, sharded: Iterable[int]) -> None:
        super().__init__()
        self.tracker = tracker
        self.sharded = set(sharded)
        self.paused = 0
        self.world = comm.get_group_size()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        tracked, sharded = self._tracked(args, kwargs)
        if sharded and torch.is_grad_enabled() and not _is_metadata(func):
            self._check_whole(sharded[0], op_name(func))  # raises (optimizers run in no_grad)
        if not tracked:
            return func(*args, **kwargs)
        kind = OP_KINDS.get(func)
        if kind is None:
            return self._other(func, args, kwargs, tracked)
        if all(s == "rep" for s in tracked):  # whole on every rank: run replicated
            return self._put(func(*args, **kwargs), "rep")
        rule = _RULES[kind]
        return rule(self, func, args, kwargs)

    def _tracked(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[State], list[T]]:
        """The states of the tracked tensors among the arguments, and the sharded parameters."""
        flat = [
            b
            for a in (*args, *kwargs.values())
            for b in (a if isinstance(a, list | tuple) else (a,))
            if isinstance(b, T)
        ]
        found = (self.tracker.find(t) for t in flat)
        states = [f[0] for f in found if f is not None]
        return states, [t for t in flat if id(t) in self.sharded]

    def _other(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], st: list[Any]
    ) -> Any:
        if _is_metadata(func):
            return func(*args, **kwargs)
        if func in _VALUE_READS and all(s == "rep" for s in st):
            return func(*args, **kwargs)
        raise UnsupportedParallelError(
            f"torch op {op_name(func)} on a parallel activation is not supported in semi_auto; "
            f"supported unannotated ops: {sorted({op_name(f) for f in OP_KINDS})} (or use a "
            f"shardwise primitive)"
        )

    # -- states --------------------------------------------------------------------------
    def state(self, t: T) -> tuple[State, Shape]:
        found = self.tracker.find(t)
        return found if found is not None else ("rep", tuple(int(s) for s in t.shape))

    def to_dp(self, t: T, who: str) -> T:
        """`t` as this rank's rows of the data-parallel layout."""
        state, shape = self.state(t)
        if state == "dp":
            return t
        if t.dim() == 0 or shape[0] % self.world:
            raise UnsupportedParallelError(
                f"{who}: dim 0 of an input of global shape {list(shape)} cannot be split over "
                f"{self.world} ranks (data parallel needs it divisible)"
            )
        if state == "rep":
            self._check_whole(t, who)
            rows = shape[0] // self.world
            rank = comm.get_rank()
            return t[rank * rows : (rank + 1) * rows]
        check_rank_order(state.matrix)
        return redistribute(t, state, data_parallel_layout(state.matrix, len(shape)), shape)

    def to_whole(self, t: T, who: str) -> T:
        """`t` whole on every rank (weights, biases, reduced values)."""
        state, shape = self.state(t)
        if state == "dp":
            raise UnsupportedParallelError(
                f"{who}: a data-parallel activation is used where a whole tensor is needed"
            )
        if state == "rep":
            self._check_whole(t, who)
            return t
        return redistribute(t, state, replicated_layout(state.matrix, len(shape)), shape)

    def _check_whole(self, t: T, who: str) -> None:
        if id(t) in self.sharded:
            raise UnsupportedParallelError(
                f"{who}: a parameter sharded for a shardwise primitive is also used by an "
                f"unannotated torch op; give it to primitives only"
            )

    def put_dp(self, out: T) -> T:
        shape = (int(out.shape[0]) * self.world, *(int(s) for s in out.shape[1:]))
        self.tracker.put(out, "dp", shape)
        return out

    def _put(self, out: Any, state: State) -> Any:
        if isinstance(out, T):
            if state == "dp":
                return self.put_dp(out)
            self.tracker.put(out, state, tuple(int(s) for s in out.shape))
        return out

    def reduce_rows(self, local: T, mean: bool) -> T:
        """A value reduced over this rank's rows -> the same reduction over the global batch."""
        out: T = comm.AllReduce("sum", None)(local)
        if mean:
            out = out / self.world
        self.tracker.put(out, "rep", tuple(int(s) for s in out.shape))
        return out


def _elementwise(m: DataParallelOps, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> T:
    who = op_name(func)
    tensors = [a for a in (*args, *kw.values()) if isinstance(a, T)]
    ndim = max(t.dim() for t in tensors)

    def convert(a: Any) -> Any:
        if not isinstance(a, T):
            return a
        aligned = a.dim() == ndim > 0 and m.state(a)[1][0] != 1
        return m.to_dp(a, who) if aligned else m.to_whole(a, who)

    out = func(*(convert(a) for a in args), **{k: convert(v) for k, v in kw.items()})
    return m.put_dp(out)


def _rowwise(m: DataParallelOps, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> T:
    who = op_name(func)
    x, rest = args[0], args[1:]
    dim = kw.get("dim", rest[0] if rest and func in _SOFTMAX else None)
    if func in _SOFTMAX and isinstance(dim, int) and dim % max(x.dim(), 1) == 0:
        raise UnsupportedParallelError(f"{who}: over dim 0 of a data-parallel activation")
    local = m.to_dp(x, who)

    def whole(a: Any) -> Any:
        return m.to_whole(a, who) if isinstance(a, T) else a

    out = func(local, *(whole(a) for a in rest), **{k: whole(v) for k, v in kw.items()})
    if not isinstance(out, T) or out.dim() == 0 or out.shape[0] != local.shape[0]:
        raise UnsupportedParallelError(
            f"{who}: changes dim 0 of a data-parallel activation (local {list(local.shape)} -> "
            f"{list(out.shape) if isinstance(out, T) else out}); only ops keeping dim 0 run "
            f"data parallel"
        )
    return m.put_dp(out)


def _loss(m: DataParallelOps, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> T:
    who = op_name(func)
    bound = inspect.signature(func).bind(*args, **kw)
    given = bound.arguments
    if given.get("size_average") is not None or given.get("reduce") is not None:
        raise UnsupportedParallelError(f"{who}: legacy size_average / reduce arguments")
    reduction = given.get("reduction", "mean")
    if given.get("weight") is not None and reduction == "mean":
        raise UnsupportedParallelError(f"{who}: class weights with reduction='mean'")
    given["input"] = m.to_dp(given["input"], who)
    given["target"] = m.to_dp(given["target"], who)
    out: T = func(*bound.args, **bound.kwargs)
    if reduction == "none":
        return m.put_dp(out)
    return m.reduce_rows(out, mean=reduction == "mean")


def _reduce(m: DataParallelOps, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> T:
    x = args[0]
    dim = kw.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else None)
    dims = None if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    if dims is not None and all(d % x.dim() != 0 for d in dims):
        return _rowwise(m, func, args, kw)
    out = func(m.to_dp(x, op_name(func)), *args[1:], **kw)
    return m.reduce_rows(out, mean=func in (torch.mean, T.mean))


_RULES: dict[str, Callable[[DataParallelOps, Any, tuple[Any, ...], dict[str, Any]], T]] = {
    "elementwise": _elementwise,
    "rowwise": _rowwise,
    "linear": _rowwise,
    "loss": _loss,
    "reduce": _reduce,
}
