"""Unannotated torch ops run data parallel (MindSpore semi_auto semantics).

`DataParallelOps` is a `TorchFunctionMode` active during a wrapped call. A torch function that
touches no tracked tensor (`Tracker`) runs unchanged (the optimizer, constants such as a causal
``torch.tril`` mask made in the network, meta tracing). One that does is looked up in `OP_KINDS`,
the table of supported op kinds, and run by its kind's rule (`_torchop_rules.RULES`, which says
which function does which step):

- ``elementwise`` (broadcasting ``+ - * / **``, comparisons, activations, ``sqrt`` / ``rsqrt``,
  ``masked_fill``, ``where``): every input with the output's rank and a dim 0 larger than 1 is
  brought to the data-parallel layout (``"dp"``: dim 0 split over all ranks), the others
  (biases, scalars, reduced values, an [S, S] mask against [B, H, S, S] scores) stay whole; the
  result is ``"dp"``. ``attention`` (``F.scaled_dot_product_attention`` with ``dropout_p=0``)
  likewise.
- ``rowwise`` / ``linear`` (view / reshape / flatten keeping dim 0, softmax off dim 0,
  ``F.linear``), ``rowstat`` (``var`` / ``std`` off dim 0), ``index`` (``x[:, 0]``,
  ``x[..., :4]``), ``dims`` (``transpose`` / ``permute`` / ``unsqueeze`` / ``squeeze(dim)`` /
  ``split`` / ``chunk`` keeping dim 0 first), ``cast`` (``float``, ``to(dtype)``, ...),
  ``norm`` (``F.layer_norm`` / ``F.rms_norm`` over trailing dims), ``embedding``: the first
  tensor becomes ``"dp"``, every other tensor (weights, tables) must be whole; the result(s)
  ``"dp"``. ``join`` (``cat`` / ``stack`` off dim 0): every input ``"dp"``. ``matmul``:
  ``x @ weight`` (rows of x) or batched activations of rank >= 3 (rows of both).
- ``dropout`` (``F.dropout``, so ``nn.Dropout``; ``torch.dropout``): this rank's rows of one
  global mask drawn like a single-device run's (`communication.replicated_draw`).
- ``loss`` (cross entropy, nll, mse, l1): input and target become ``"dp"``; ``"mean"`` /
  ``"sum"`` losses become one replicated value (local loss, AllReduce(sum), / world size for
  the mean: equal local batch sizes; `reduce_rows`, with `sum_over_ranks`; one rank: no
  collective), ``"none"`` stays ``"dp"``. ``loss.backward()`` without a gradient runs inside
  `communication.primitives.replicated_seed(loss)`: the seed is ones on every rank, so the
  loss's backward multiplies by the world size instead of all-reducing.
- ``reduce`` (``sum`` / ``mean``): over all dims or dims containing 0 as the losses; over other
  dims row-wise.

An op that would touch dim 0 (index it, join or move it, contract it, normalize over it) raises
`UnsupportedParallelError` naming the op and what would work. A ``full_batch`` input
(`Tracker.batch`) is taken as this rank's rows by the first unannotated op that uses it
(`_batch_rows`: a local slice, no communication), so the ops after it run data parallel; an op
that needs the whole batch (it touches dim 0) runs it whole. A tracked input whose state is
``"rep"`` everywhere (a loss, a reduced value) runs whole on every rank (dropout: with the
whole global mask). Metadata reads (``shape``, ``size()``, ``backward()``, ...) pass; any other
op on a tracked tensor raises `UnsupportedParallelError` naming the op.

While an optimizer steps without a closure (global step hooks, `_step_pre` / `_step_post`)
the active modes let every op through unexamined: the update touches parameters and state
only, and looking at each of its many small ops cost about 1 ms per step on a small MLP. The
mode on top of the thread's torch-function stack is even taken off it for the step (`_lift`,
put back by `_step_post`, or by its own exit when the step raised; a step that raised inside
another step is undone when the outer one ends): each op still routed through a mode costs
~2 us of Python, ~0.4 ms per AdamW step of a 3-layer MLP. A step with a closure (LBFGS) runs
the network again, so it is examined as usual.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
import torch.optim.optimizer as torch_optimizer
from torch.overrides import TorchFunctionMode

from shardwise import communication as comm
from shardwise.communication.primitives import replicated_seed, sum_over_ranks
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._runtime import data_parallel_layout, replicated_layout
from shardwise.parallel._torchop_rules import RULES, op_name
from shardwise.parallel._tracker import Shape, State, Tracker, check_rank_order
from shardwise.redistribution import redistribute

T = torch.Tensor
_ELEMENTWISE: list[Callable[..., Any]] = [
    T.add, T.__add__, T.__radd__, T.sub, T.__sub__, T.__rsub__, T.mul, T.__mul__, T.__rmul__,
    T.div, T.__truediv__, T.__rtruediv__, T.neg, T.__neg__, torch.add, torch.sub, torch.mul,
    torch.div, torch.neg, torch.relu, T.relu, F.relu, F.gelu, F.silu, torch.sigmoid, T.sigmoid,
    torch.tanh, T.tanh, torch.exp, T.exp, torch.log, T.log, torch.sqrt, T.sqrt, torch.rsqrt,
    T.rsqrt, torch.pow, T.pow, T.__pow__, T.__rpow__, torch.abs, T.abs, T.masked_fill,
    torch.masked_fill, torch.where, T.__eq__, T.__ne__, T.eq, T.ne, T.lt, T.le, T.gt, T.ge,
]  # fmt: skip
_ROWWISE: list[Callable[..., Any]] = [
    T.view, T.reshape, torch.reshape, T.flatten, torch.flatten, F.softmax, F.log_softmax,
    T.softmax, T.log_softmax, torch.softmax, torch.log_softmax, T.detach, T.contiguous, T.clone,
]  # fmt: skip
_DIMS: list[Callable[..., Any]] = [
    T.transpose, torch.transpose, T.permute, torch.permute, T.unsqueeze, torch.unsqueeze,
    T.squeeze, torch.squeeze, T.split, torch.split, T.chunk, torch.chunk,
]  # fmt: skip
_CASTS: list[Callable[..., Any]] = [
    T.float, T.double, T.half, T.bfloat16, T.long, T.int, T.bool, T.to, T.type_as,
]  # fmt: skip
_MATMUL: list[Callable[..., Any]] = [torch.matmul, T.matmul, T.__matmul__, torch.bmm, T.bmm]
_LOSSES: list[Callable[..., Any]] = [F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss]

OP_KINDS: dict[Callable[..., Any], str] = {
    **{f: "elementwise" for f in _ELEMENTWISE},
    F.scaled_dot_product_attention: "attention",
    **{f: "rowwise" for f in _ROWWISE},
    F.linear: "linear",
    **{f: "rowstat" for f in (T.var, torch.var, T.std, torch.std)},
    T.__getitem__: "index",
    **{f: "join" for f in (torch.cat, torch.concat, torch.stack)},
    **{f: "dims" for f in _DIMS},
    **{f: "cast" for f in _CASTS},
    F.embedding: "embedding",
    **{f: "norm" for f in (F.layer_norm, F.rms_norm)},
    **{f: "matmul" for f in _MATMUL},
    **{f: "dropout" for f in (F.dropout, torch.dropout)},
    **{f: "loss" for f in _LOSSES},
    **{f: "reduce" for f in (torch.sum, T.sum, torch.mean, T.mean)},
}
"""The supported torch ops on tracked tensors and their kind (see the module docstring); each
kind's rule is `_torchop_rules.RULES[kind]`."""

_METADATA = {T.size, T.dim, T.ndimension, T.is_contiguous, T.is_floating_point, T.backward}
_VALUE_READS = {T.item, T.tolist, T.__float__, T.__format__, T.__repr__, T.__bool__}


def _is_metadata(func: Callable[..., Any]) -> bool:
    """Shape / dtype queries, attribute reads and writes, ``backward``."""
    return func in _METADATA or getattr(func, "__name__", "") in ("__get__", "__set__")


def _seeded(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A ``Tensor.backward`` call without a gradient (the seed is ones, on every rank)."""
    gradient = args[1] if len(args) > 1 else kwargs.get("gradient")
    return gradient is None and bool(args) and isinstance(args[0], T)


class DataParallelOps(TorchFunctionMode):
    """Runs the ops of `OP_KINDS` on tracked tensors data parallel (see the module docstring).

    `paused` > 0 lets everything through (set while a primitive or the planner runs).
    `sharded`: parameter id -> whether it is stored as a block (not whole). Inside the network's
    forward (`in_network` > 0) a torch op gets each listed parameter through `whole` (its whole
    value: AllGather of a block, exact backward, or optimizer parallel's compute leaf:
    `gather_params`); outside it, with autograd on (e.g. a penalty on the weights in a train
    step), a block is refused; under ``no_grad`` (the optimizer's update) everything passes.
    """

    def __init__(
        self,
        tracker: Tracker,
        sharded: Mapping[int, bool],
        whole: Callable[[T], T] | None = None,
    ) -> None:
        super().__init__()
        self.tracker = tracker
        self.sharded = dict(sharded)
        self.whole = whole
        self.paused = 0
        self.in_network = 0
        self.stepping = 0  # > 0: an optimizer (without closure) is stepping
        self.lifted = False  # off the torch-function stack while an optimizer steps
        self.world = comm.get_group_size()
        self._rows: dict[int, T] = {}  # full_batch input id -> this rank's rows of it

    def __enter__(self) -> DataParallelOps:
        _register_step_hooks()
        _ACTIVE.add(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.discard(self)
        # (entries left by steps that raised: none is needed once no mode is active)
        _lifted()[:] = [e for e in _lifted() if e[1] is not self] if _ACTIVE else []
        if self.lifted:  # an optimizer step raised: `_step_post` never put it back
            self.lifted = False
            return
        super().__exit__(*exc)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is T.backward and _seeded(args, kwargs):
            with replicated_seed(args[0]):
                return func(*args, **kwargs)
        if self.paused or self.stepping or _is_metadata(func):  # (metadata always passes)
            return func(*args, **kwargs)
        tracked, sharded = self._tracked(args, kwargs)
        if self.in_network and self._has_param(args, kwargs):
            args, kwargs = self.gather_params(args, kwargs)
            tracked, sharded = self._tracked(args, kwargs)
        if sharded and torch.is_grad_enabled():
            self._check_whole(sharded[0], op_name(func))  # raises (optimizers run in no_grad)
        if not tracked:
            return func(*args, **kwargs)
        kind = OP_KINDS.get(func)
        if kind is None:
            return self._other(func, args, kwargs, tracked)
        if self.tracker.batch:
            rows = self._batch_rows(args, kwargs)
            if rows is not None:
                try:  # this rank's share of a full_batch input, as for "data_parallel"
                    return RULES[kind](self, func, *rows)
                except UnsupportedParallelError:
                    pass  # the op needs the whole batch (it touches dim 0): run it whole
        if kind != "dropout" and all(s == "rep" for s in tracked):  # whole on every rank
            return self._put(func(*args, **kwargs), "rep")
        return RULES[kind](self, func, args, kwargs)

    def _batch_rows(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The arguments with every ``full_batch`` input (`Tracker.batch`) whose dim 0 divides
        by the world size replaced by this rank's rows of it (tracked ``"dp"``, one slice per
        input and call); None when there is none."""
        batch, cache = self.tracker.batch, self._rows
        found = False

        def rows(a: Any) -> Any:
            nonlocal found
            if isinstance(a, list | tuple):
                return type(a)(rows(b) for b in a)
            if not isinstance(a, T) or batch.get(id(a)) is not a or a.shape[0] % self.world:
                return a
            found = True
            if id(a) not in cache:
                cache[id(a)] = self.put_dp(self.to_dp(a, "full_batch input"))
            return cache[id(a)]

        out = tuple(rows(a) for a in args), {k: rows(v) for k, v in kwargs.items()}
        return out if found else None

    def _has_param(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return any(
            id(b) in self.sharded
            for a in (*args, *kwargs.values())
            for b in (a if isinstance(a, list | tuple) else (a,))
        )

    def gather_params(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with every sharded parameter replaced by its whole value."""

        def whole(a: Any) -> Any:
            if isinstance(a, list | tuple):
                return type(a)(whole(b) for b in a)
            if not isinstance(a, T) or id(a) not in self.sharded or self.whole is None:
                return a
            self.paused += 1
            try:
                return self.whole(a)
            finally:
                self.paused -= 1

        return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

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
        return states, [t for t in flat if self.sharded.get(id(t), False)]

    def _other(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], st: list[Any]
    ) -> Any:
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
        if self.sharded.get(id(t), False):
            raise UnsupportedParallelError(
                f"{who}: a parameter stored as blocks (for a shardwise primitive or a "
                f"parameter_plan) is used by a torch op outside the network's forward; use it "
                f"inside the network, or under torch.no_grad() for an in-place update"
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
        out = sum_over_ranks(local, None, self.world if mean else 1)
        self.tracker.put(out, "rep", tuple(int(s) for s in out.shape))
        return out


_ACTIVE: weakref.WeakSet[DataParallelOps] = weakref.WeakSet()  # entered, not yet exited
_STEP_HOOKS: list[Any] = []  # the global optimizer step hooks, registered once
_THREAD = threading.local()  # .lifted: per open step of this thread, (optimizer id, lifted mode)


def _register_step_hooks() -> None:
    """Register the global step hooks once; keep the pre-hook first and the post-hook last, so
    other step hooks (optimizer parallel's) also run with the mode lifted."""
    if not _STEP_HOOKS:
        _STEP_HOOKS.append(torch_optimizer.register_optimizer_step_pre_hook(_step_pre))
        _STEP_HOOKS.append(torch_optimizer.register_optimizer_step_post_hook(_step_post))
    pre = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    post = getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    if pre is not None and _STEP_HOOKS[0].id in pre:
        pre.move_to_end(_STEP_HOOKS[0].id, last=False)
    if post is not None and _STEP_HOOKS[1].id in post:
        post.move_to_end(_STEP_HOOKS[1].id)


_Lifted = tuple[int, "DataParallelOps | None"]


def _lifted() -> list[_Lifted]:
    stack: list[_Lifted] | None = getattr(_THREAD, "lifted", None)
    if stack is None:
        stack = _THREAD.lifted = []
    return stack


def _put_back(mode: DataParallelOps | None) -> None:
    if mode is not None and mode.lifted:
        mode.lifted = False
        torch._C._push_on_torch_function_stack(mode)


def _lift() -> DataParallelOps | None:
    """Take the top of this thread's torch-function mode stack off it when it is an active
    `DataParallelOps` (anything else stays: that mode keeps passing the ops through)."""
    if torch._C._len_torch_function_stack() == 0:
        return None
    top = torch._C._pop_torch_function_stack()
    if isinstance(top, DataParallelOps) and top in _ACTIVE and not top.lifted:
        top.lifted = True
        return top
    torch._C._push_on_torch_function_stack(top)
    return None


def _no_closure(args: Any, kwargs: Any) -> bool:
    """The step's arguments (``args[0]`` is the optimizer itself) hold no closure."""
    return len(args) <= 1 and not kwargs


def _step_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # (no active mode: nothing to do; a closure re-runs the network: keep examining its ops)
    if _ACTIVE and _no_closure(args, kwargs):
        for mode in _ACTIVE:
            mode.stepping += 1
        _lifted().append((id(optimizer), _lift()))


def _step_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stack = _lifted()
    if not _no_closure(args, kwargs) or all(key != id(optimizer) for key, _ in stack):
        return
    while stack:  # (entries above this step's: steps inside it that raised, undone too)
        key, lifted = stack.pop()
        for mode in _ACTIVE:
            mode.stepping = max(0, mode.stepping - 1)
        _put_back(lifted)
        if key == id(optimizer):
            return
