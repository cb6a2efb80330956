"""Run the plan's purely local stretches at plain torch speed (`SpanRunner`, `SpanHooks`).

A node is *local* when the executor runs its op on this rank's blocks exactly as the network
calls it (`NodeTable.local`): a plain torch op (`PLAIN`; not a shardwise primitive), a view or
split the network already gives the plan's local sizes (checked the first time it runs:
`SpanRunner.check_sized`), an ``nn.Dropout`` whose ``p`` is 0, a scaled-dot-product attention
whose first call had ``dropout_p`` 0. For such a node the executor does
nothing but count it; watching it costs only the torch-function mode's call into Python (a few
microseconds an op).

1. After a plan's first complete run, `span_candidates` picks the outermost modules whose every
   op is a local node, in one contiguous run of the plan, at least `MIN_OPS` of them (a GPT
   block, an MLP). `SpanHooks` puts a forward pre-hook and a forward hook on each.
2. The next run *observes* each candidate: the cursor when it is entered and when it returns is
   its span ``[a, b)``, kept when every node in it is local (`SpanRunner.span_enter` /
   `span_leave`). A module that is seen with two different spans is never skipped.
3. From then on, a candidate entered at cursor ``a`` (its dropouts' ``p`` still 0) runs with
   the executor off the torch-function mode stack, and the cursor moves to ``b`` when it
   returns: its ops run unexamined, as the plan says they run. A module that raises puts the
   cursor back at ``a``, so whatever the network calls next is checked against the plan.

The same trade is made after the optimizer step of a call whose forward begins inside the
network (`SpanRunner.park`): the executor stays off the stack (``zero_grad``'s hundred attribute
reads and writes, logging) until the network is called again (`SpanRunner.network_entered`),
then goes back where it was (`_stepping.SteppingMode._relist`).

What this gives up: an op sequence that changes *inside* a skipped module from one call to the
next (a branch on a Python flag or a step counter inside a GPT block) is not noticed, so it is
not planned again: its new ops run as local ops; so is an attention inside one that starts to
drop weights (``dropout_p`` from 0 to > 0: a module planned in ``eval()`` then trained), which
then draws its own mask on each rank. So this runs only when the user opts in with
``sw.set_auto_parallel_context(watch_every_op=False)`` (the default True leaves `SpanHooks`
disabled: every op is watched).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise.parallel._node_table import DROPOUT
from shardwise.planner._draws import SDPA

if TYPE_CHECKING:
    from shardwise.parallel._node_table import NodeTable

T = torch.Tensor
MIN_OPS = 4  # (a hooked module call costs about as much as watching two or three ops)


def span_candidates(
    names: Sequence[str], local: Sequence[bool | None], modules: Sequence[tuple[str, nn.Module]]
) -> set[str]:
    """The outermost callable modules (`modules`: ``named_modules()``) whose ops (nodes named
    ``path/op``, `names`) are all local (`local`) and contiguous, at least `MIN_OPS` of them."""
    ops: dict[str, list[int]] = {}
    for k, name in enumerate(names):
        for path in _enclosing(name):
            ops.setdefault(path, []).append(k)
    chosen: set[str] = set()
    for path, module in modules:  # (parents come before their children)
        if not path or any(path.startswith(c + ".") for c in chosen):
            continue
        ks = ops.get(path, [])
        if (
            len(ks) >= MIN_OPS
            and ks[-1] - ks[0] + 1 == len(ks)
            and all(local[k] for k in ks)
            and type(module).forward is not nn.Module.forward  # (ModuleList: never called)
        ):
            chosen.add(path)
    return chosen


def _enclosing(name: str) -> list[str]:
    """The paths of the modules a node named ``a.b.c/op`` runs in, outermost first
    (``a``, ``a.b``, ``a.b.c``)."""
    path = name.rpartition("/")[0]
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


class SpanRunner:
    """The executor's half for spans (mixed into `_executor.PlanExecutor`, which sets these
    attributes; see the module docstring)."""

    table: NodeTable
    cursor: int
    paused: int
    lifted: bool
    backward_seen: bool
    param_value: Any
    started: list[Any]

    if TYPE_CHECKING:

        @property
        def done(self) -> bool: ...

        def _lift(self) -> bool: ...

        def _relist(self) -> None: ...

        def finish_started(self) -> None: ...

    def _spans_init(self) -> None:
        self.skipping: tuple[str, int, int] | None = None  # (module, its span)
        self.watching: dict[str, int] = {}  # observed candidates: the cursor at their entry
        self.parked = False  # off the stack after an optimizer step (`park`)
        self.entered = False  # the network's forward began since the plan last started

    def check_sized(self, func: Callable[..., Any], k: int, args: Any, kwargs: Any) -> Any:
        """A view (or split) given the plan's local sizes, the first time: whether the network's
        own sizes give the same shapes decides whether the node is local."""
        sized = self.table.sized[k] or ()
        out = self.table.as_sized.get(k, func)(args[0], *sized)
        try:
            own = func(*args, **kwargs) if kwargs else func(*args)
        except (RuntimeError, ValueError, TypeError):
            own = None
        self.table.local[k] = _shapes(own) == _shapes(out)
        return out

    def span_enter(self, name: str) -> None:
        """A candidate module is entered: skip it (its span is known and starts here), or
        start observing it."""
        if self.skipping is not None or self.paused or self.lifted:
            return
        if self.param_value is not None:  # (parameters enter ops through the engine)
            return
        span = self.table.spans.get(name, ())
        if span is None:  # (seen with two spans)
            return
        if not span:
            self.watching[name] = self.cursor
            return
        if span[0] != self.cursor or any(m.p != 0 for m in self.table.guards.get(name, ())):
            return  # (elsewhere in the plan; a dropout module's p no longer 0)
        if self.started:  # (a returned value of this forward, read inside: whole first)
            self.finish_started()
        if self._lift():
            self.skipping = (name, span[0], span[1])

    def span_leave(self, name: str, out: Any) -> None:
        """A candidate module returns (`out`; None when it raised): back on the stack after a
        skip, the cursor past its ops (when it raised: at its first op, so that what the
        network calls next is checked against the plan), or its observed span recorded."""
        if self.skipping is not None:
            if self.skipping[0] == name:
                self.cursor = self.skipping[2] if out is not None else self.skipping[1]
                self.skipping = None
                self._relist()
            return
        start = self.watching.pop(name, None)
        if start is None:
            return
        table = self.table
        span = (start, self.cursor)
        ok = out is not None and 0 < start < self.cursor and all(table.local[start : self.cursor])
        known = table.spans.get(name, ())
        table.spans[name] = span if ok and known in ((), span) else None

    def park(self) -> bool:
        """After an optimizer step: whether to stay off the mode stack until the network is
        called again (the plan ran, its backward too, and its first op is in the network)."""
        table = self.table  # (not in a plan's first call: `SpanHooks.update` not run yet)
        self.parked = (
            self.backward_seen
            and self.done
            and table.candidates is not None
            and table.first_in_network is True
        )
        return self.parked

    def network_entered(self) -> None:
        """The network's forward begins: back on the stack when parked."""
        self.entered = True
        if self.parked:
            self.parked = False
            self._relist()

    def first_op(self) -> None:
        """The plan's first op runs: whether it came after the network's forward began (every
        time so far) says whether `park` may wait for the network."""
        table = self.table
        table.first_in_network = self.entered and table.first_in_network is not False
        self.entered = False


def _shapes(out: Any) -> Any:
    """The shapes of a view's (a split's) result."""
    if isinstance(out, T):
        return tuple(out.shape)
    if isinstance(out, (tuple, list)):
        return [tuple(o.shape) if isinstance(o, T) else None for o in out]
    return None


class SpanHooks:
    """Forward hooks on the candidate modules of every plan run so far (`span_candidates`),
    which tell the running executor (`executor()`) about their calls."""

    def __init__(
        self, network: nn.Module, executor: Callable[[], Any], enabled: bool = True
    ) -> None:
        self.network = network
        self.executor = executor
        self.enabled = enabled  # (False: ``watch_every_op``)
        self.hooked: set[str] = set()
        self.handles: list[RemovableHandle] = []

    def update(self, table: NodeTable) -> None:
        """After a complete run of `table`'s plan: choose its candidates (once) and hook them."""
        if table.candidates is not None:
            return
        if not self.enabled:
            table.candidates, table.first_in_network = set(), False  # (never parks either)
            return
        modules = list(self.network.named_modules())
        by_name = dict(modules)
        guards: dict[str, list[nn.Dropout]] = {}
        for k, name in enumerate(table.names):  # a dropout is local as an nn.Dropout, p = 0
            if table.fast[k] != DROPOUT or not table.local[k] or table.ops[k] == SDPA:
                continue  # (an attention: local while its calls had dropout_p 0 when seen)
            *outer, path = _enclosing(name) or [""]
            module = by_name.get(path)
            if not isinstance(module, nn.Dropout):
                table.local[k] = False
                continue
            for p in outer:
                guards.setdefault(p, []).append(module)
        table.candidates = span_candidates(table.names, table.local, modules)
        table.guards = {c: guards.get(c, []) for c in table.candidates}
        for path, module in modules:
            if path in table.candidates and path not in self.hooked:
                self.hooked.add(path)
                self.handles.append(module.register_forward_pre_hook(self._enter(path)))
                leave = module.register_forward_hook(self._leave(path), always_call=True)
                self.handles.append(leave)

    def _enter(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            executor = self.executor()
            if executor is not None and path in (executor.table.candidates or ()):
                executor.span_enter(path)

        return hook

    def _leave(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            executor = self.executor()
            if executor is not None:
                executor.span_leave(path, out)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.hooked = [], set()
