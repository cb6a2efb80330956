"""Run a `ParallelPlan` on this rank: each torch op of the captured graph, on local blocks.

`PlanExecutor` is a ``TorchFunctionMode`` active during one wrapped call. The k-th torch-level
call the network (or train step) makes is the plan's node k (the capture recorded the calls the
same way, `planner.is_recorded`), its op on node k's parameters (`_param_reads`). For it the
executor:

1. moves each tensor input as the plan's edge into that node says (`planner.EdgePlan`: an
   AllReduce of partial values, then Slice / AllGather / AlltoAll steps, all autograd-aware; a
   ``shared`` edge reuses the value an earlier edge of this forward moved the same way in
   the same grad mode (`_node_run.grad_mode`: a move made under ``torch.no_grad()`` has no
   autograd link, so a training forward after it moves again);
   a whole value wanted partial is kept on the first rank of those axes; `_edges.move`);
   a parameter is first taken as stored (optimizer parallel: its compute leaf);
2. runs the op on the local blocks: size arguments of ``view`` / ``reshape`` / ``expand`` become
   the plan's local output shape, those of a ``split`` along a split dim (a strided q/k/v
   projection) the parts' local sizes; ``F.dropout`` multiplies by this rank's block of one global
   mask (drawn like a single-device run draws it, so masks match one device), and so does an
   attention with ``dropout_p > 0``, computed in its math form (`_local.attention_dropout`); a
   parameter the op returned itself (``w.float()``) is handed on as a view, as captured
   (`_param_reads.passing`);
3. applies the edges of returned values right after the op; the loss's AllReduce is only
   started there (`sum_over_ranks`) and finished before anything can read the loss: at the
   next call the mode sees, after ``loss.backward()`` (which needs no value of it, so the two
   overlap), before an optimizer step or a primitive, at the end of the call; then the
   AllReduce(avg)s of output gradients the plan puts there (`NodePlan.backward`, registered on
   the outputs for backward: `_edges.average_outputs`).

What each node needs is worked out once per plan (`_node_table.NodeTable`): a node with no
edge in or out and no gradient average (nearly every node under data parallel) takes a short
path in `PlanExecutor.__torch_function__` (its op, and the parameters a node reading some
gets, checked against the plan's, the cursor moved, the op run; a sized or dropout node's op
through `_node_run.NodeRun._short`); the others take the full path (`PlanExecutor._call`:
the node matched and the cursor moved by `PlanExecutor._advance`, then run by
`_node_run.NodeRun._run`, or by `NodeRun._factory` for a call without tensor inputs). From a
plan's third run, modules made only of such nodes run with the executor off the mode stack,
and after an optimizer step it may stay off until the network is called again
(`_spans.SpanRunner`).

Nothing about layouts is decided here: every placement, step and collective comes from the plan.
A later pass of the plan in the same call (gradient accumulation) starts where `_passes.Passes`
says. Calls after the graph ends (``loss.backward()``, the optimizer's step, logging) run
unchanged, as do calls on a parameter's ``.grad`` before the forward
(``zero_grad(set_to_none=False)``: `_node_run.NodeRun.on_gradient`); ``loss.backward()`` and
``torch.autograd.grad`` go through
`_differentiate.Differentiate` (the pass must be complete; a root split over the ranks has its
seed scaled: `_seeds.Seeds`). An optimizer
step without a closure takes the executor off the torch-function mode stack until it ends
(`_stepping.SteppingMode`, its base), so its ops do not reach Python here. A shardwise primitive
is one node, run through module hooks (`_executor_primitives.PrimitiveHooks`). An
activation-checkpointed region's recomputation in backward replays the plan's nodes
(`_recompute.Recompute`). An output the
plan holds other than a returned value leaves the call (a partial sum, a model-parallel split)
is noted as its op makes it (`_leaving.Leaving`: moved if the train step returns it)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from shardwise._torch import pytree
from shardwise._torch.checkpointing import checkpoint_calls, checkpointing
from shardwise.parallel._differentiate import Differentiate
from shardwise.parallel._errors import Replan, plan_mismatch, split_values_note
from shardwise.parallel._executor_primitives import PrimitiveHooks
from shardwise.parallel._leaving import Leaving, Placings
from shardwise.parallel._node_run import NodeRun, check_flag_change, has_tensor
from shardwise.parallel._node_table import (
    CALLS,
    PLAIN,
    SLOW,
    NodeTable,
    call_info,
)
from shardwise.parallel._param_reads import alike, call_fits, call_reads, kept_apart
from shardwise.parallel._passes import Passes
from shardwise.parallel._recompute import Recompute
from shardwise.parallel._seeds import Seeds
from shardwise.parallel._sizes import Sizes
from shardwise.parallel._spans import SpanRunner
from shardwise.parallel._stepping import SteppingMode
from shardwise.planner import EdgePlan, ParallelPlan, Placed
from shardwise.planner._local_factories import NEW_FILLS, fill_shape

T = torch.Tensor


GRAD_GET = "torch.Tensor.grad.__get__"  # (the op name of a ``t.grad`` read: `call_info`)


class PlanExecutor(
    Passes,
    Sizes,
    Leaving,
    NodeRun,
    PrimitiveHooks,
    Recompute,
    Seeds,
    Differentiate,
    SpanRunner,
    SteppingMode,
):
    """Carries out `plan` (see the module docstring).

    Args:
        plan: the plan.
        params: parameter id -> its name, for the parameters the plan stores (called when
            first needed).
        param_value: the value a parameter enters an op with (default: itself).
        templates: each node's captured arguments (`planner.Node.args` / ``kwargs``): an op
            whose inputs are all whole gets the captured sizes where user code computed its
            own from local shapes (`_sizes.Sizes`).
        on_end: called each time the plan's last op has run (the end of the forward).
        on_start: called each time the plan's first op is about to run.
        table: the plan's `NodeTable` (made from `plan` and `templates` when None).
    """

    def __init__(
        self,
        plan: ParallelPlan,
        params: Callable[[], dict[int, str]],
        param_value: Callable[[T], T] | None = None,
        templates: list[tuple[Any, Any]] | None = None,
        on_end: Callable[[], None] | None = None,
        on_start: Callable[[], None] | None = None,
        table: NodeTable | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.table = table if table is not None else NodeTable(plan, templates)
        self.on_end = on_end
        self.on_start = on_start
        self.params_of = params
        self.known_params: dict[int, str] | None = None
        self.param_value = param_value
        self.cursor = 0
        self.count = len(plan.nodes)
        self.ops = self.table.ops
        self.reads = self.table.reads  # (per node reading parameters: which: `_param_reads`)
        self.passing = self.table.passing  # (nodes that may return a parameter: `_param_reads`)
        self.fast = self.table.fast if param_value is None else self.table.fast_no_param
        self.finished = False
        self.backward_seen = False  # (before it, a mismatch plans again: `Replan`)
        self.outside = False  # an op outside the plan ran since it last started (after backward)
        self.start = 0  # the node this pass started at (`_restarts`)
        self.run = object()  # this pass (`EdgePlan.seeded`: only its own roots seed it)
        self.network_start: int | None = None  # the node at which the network was first entered
        self.reentered = False  # the network was entered again after the plan finished
        self.made_outside: dict[int, weakref.ref[T]] = {}  # (`_passes`: id -> the tensor)
        self.inputs: dict[int, weakref.ref[T]] = {}  # (`_passes`) the call's input tensors
        self.tentative = -1  # (`_passes.Passes.abandon`: none in the first pass)
        self.in_network = False
        self.moved: dict[tuple[str, Placed, int], T] = {}  # this forward's moves (`grad_mode`)
        self.primitives: list[Any] = []  # the running primitives: (node, fix-up) or _PASSED
        self.started: list[Callable[[], None]] = []  # AllReduces of returned values, running
        # the gradients' reducer corrects shares of a backward that did not wait for a mean
        # loss's count (`EdgePlan.deferred`; set by the caller: not with optimizer parallel)
        self.defer_count = False
        # before each ``t.grad`` read, with t (hsdp level 1: reduces the gradients it holds)
        self.grad_read: Callable[[T], None] | None = None
        self.leaving = self.table.leaving  # (`_leaving`) per node: its outputs moved on return
        self.placed: Placings = {}  # (`_leaving`) such outputs made in this call
        self.buffer_moves = self.table.buffer_moves  # (`_leaving`) outputs buffers are set to
        self.buffer_made: dict[str, tuple[weakref.ref[T], EdgePlan]] = {}  # (made this call)
        self.fills: dict[int, tuple[weakref.ref[T], EdgePlan, T | None]] = {}  # (`_leaving`)
        self.network: torch.nn.Module | None = None  # (whose buffers those are: the caller's)
        self.grads: dict[int, weakref.ref[T]] = {}  # (`on_gradient`) its parameters' ``.grad``
        self.swapped: dict[int, tuple[weakref.ref[T], T]] = {}  # (`_node_run.current`)
        self._recompute_init()
        self._seeds_init()
        self.in_backward = 0  # a ``loss.backward()`` of the step runs
        self._spans_init()

    def fresh(self) -> PlanExecutor:
        """Another executor of this plan (same parameters, table): a region's replay."""
        return PlanExecutor(self.plan, self.params_of, self.param_value, table=self.table)

    @property
    def params(self) -> dict[int, str]:
        """Parameter id -> its name."""
        if self.known_params is None:
            self.known_params = self.params_of()
        return self.known_params

    @property
    def done(self) -> bool:
        """Whether every op of the plan ran."""
        return self.cursor >= self.count

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.started and func is not T.backward:  # (the loss's AllReduce: see `_returned`)
            self.finish_started()
        try:
            kind, op = CALLS[func]  # (`call_info`'s cache, read inline: a call on every op)
        except (KeyError, TypeError):
            kind, op = call_info(func)
        if kind != "op":  # (metadata, attribute reads, aliases: no node; backward: `_call`)
            if self.grad_read is not None and op == GRAD_GET:  # (``p.grad``: hsdp level 1)
                self.grad_read(args[0])
            if kind in ("backward", "grad"):
                return self._call(func, kind, op, args, kwargs or {})
            if self.placed and kind != "skip" and self.done:  # (a value read, an alias)
                return self.placed_call(func, kind, op, args, kwargs or {})
            return func(*args, **kwargs) if kwargs else func(*args)
        if self.made_outside and not self.paused and not self.done:  # (a later pass)
            self.check_inputs(op, (args, kwargs))  # (none of its ops reads those)
        k = self.cursor
        fast = self.fast[k] if k < self.count else SLOW
        if (  # a node on its short path (`NodeTable.fast`): the op (its parameters) checked
            fast and not self.paused and op == self.ops[k] and args and isinstance(args[0], T)
        ) and (k not in self.reads or self.same_params(k, args, kwargs)):
            if checkpointing():  # (about 100 ns: saved-tensor hooks, grad mode)
                self._checkpointed(k)
            self.cursor = k + 1
            self.paused += 1
            try:
                if fast == PLAIN:
                    out = func(*args, **kwargs) if kwargs else func(*args)
                else:
                    out = self._short(func, fast, k, args, kwargs)
            finally:
                self.paused -= 1
            if k in self.passing:  # (a parameter it returned itself: a view, as captured)
                out = kept_apart(out, self.params)
            leaving = self.leaving[k]
            if leaving is not None:  # (held other than it leaves the call: `_leaving`)
                self.note_placed(k, leaving, out)
            return out
        return self._call(func, kind, op, args, kwargs or {})

    def _call(
        self, func: Callable[..., Any], kind: str, op: str, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        """Any call but a plain node's: backward, calls that are no node, other nodes."""
        if kind in ("grad", "backward"):  # (the step's differentiation: `_differentiate`)
            return self.differentiate(func, kind, args, kwargs)
        if self.paused or kind != "op":
            return func(*args, **kwargs)
        if self.on_parameter(op, args):  # (before the forward or after the backward only)
            mid = self.cursor > 0 and not self.backward_seen
            check_flag_change(self.params[id(args[0])], args, kwargs, mid)
            return func(*args, **kwargs)
        if self.on_gradient(op, args, kwargs):  # (``p.grad.zero_()`` before the forward)
            return func(*args, **kwargs)
        if self.done and not self._restarts(op, (args, kwargs)):
            if not self.backward_seen:  # an op the plan does not have, before any backward
                if not has_tensor(args, kwargs):  # (Python state: leaving ``torch.no_grad()``)
                    out = func(*args, **kwargs)
                    if not any(isinstance(t, T) for t in pytree.tree_leaves(out)):
                        return out
                raise Replan(f"{op} after the plan's last op", self.cursor, op)
            if self.reentered and has_tensor(args, kwargs):  # (the network, not as planned)
                self._refuse_pass(op, (args, kwargs))
            self.outside = True
            if self.swapped:  # (a tensor changed in place in a moved copy: that copy)
                args, kwargs = pytree.tree_map(self.current, (args, kwargs))
            args, kwargs = self.fill_rows((args, kwargs))  # (a fill made whole: its rows)
            out = self.run_outside(func, op, args, kwargs)
            self.note_outside(op, (args, kwargs), out)  # (no pass may read it: `_passes`)
            return out
        self.skip_made(op)  # (a later pass: a lazy init of the first skipped)
        k = self.cursor
        if self.no_recompute and checkpointing():  # (before any op of a region's own)
            self._refuse_checkpointed(k)
        if not has_tensor(args, kwargs):
            return self._factory(func, op, args, kwargs)
        if op != self.ops[k] and self.abandon(op):  # (a pass only factories started)
            out = func(*args, **kwargs)
            self.note_outside(op, (args, kwargs), out)
            return out
        if checkpointing():
            self._checkpointed(k)
        self._advance(op, "called", args, kwargs)
        self.paused += 1
        try:
            out = self._run(func, k, args, kwargs)
        finally:
            self.paused -= 1
        leaving = self.leaving[k]
        if leaving is not None:
            self.note_placed(k, leaving, out)
            if op in NEW_FILLS:  # (``x.new_ones(b, 1)``: a fill, as `_factory`'s)
                self.note_fill(leaving, fill_shape(op, args, kwargs), out)
        if k in self.table.roots:  # (a backward starts from it: `_seeds`)
            self.note_roots(k, out)
        self._ended()
        return out

    def _ended(self) -> None:
        """After an op: when it was the plan's last, drop the moved values and call `on_end`."""
        if self.done:
            self.moved.clear()
            if self.on_end is not None:
                self._paused_call(self.on_end)

    def _paused_call(self, *callbacks: Callable[[], None]) -> None:
        """The `callbacks` (the optimizer-parallel engine's forward start / end: level 3 frees
        the gathered weights) with the executor paused: their tensor calls are not network ops."""
        for callback in callbacks:
            self._unmatched(callback)

    def finish_started(self) -> None:
        """Finish the started AllReduces of returned values (their results are whole now)."""
        started, self.started = self.started, []
        self._paused_call(*started)  # (their own tensor calls, AllReduces, are no network ops)

    def step_starts(self, optimizer: Any, closure: bool) -> None:
        self.finish_started()  # (the step's ops do not come here)
        super().step_starts(optimizer, closure)

    def stay_lifted(self) -> bool:
        if any(ref() is not None for ref, _, _ in self.placed.values()):
            return False  # (ops on those after the step are watched: `_leaving`)
        return self.park()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        try:
            if exc_val is not None and self.table.candidates is None:  # (the first call)
                with contextlib.suppress(Exception):  # (a note never replaces the error)
                    split_values_note(exc_val, self.plan, self.cursor)
            self.finish_started()
        finally:  # (off the mode stack even when finishing raised)
            super().__exit__(exc_type, exc_val, exc_tb)

    def _advance(self, op: str, did: str, args: tuple[Any, ...], kwargs: Any) -> None:
        """Step to the next node, which must be `op` on the parameters it read (the call's
        `args`, `_param_reads`; after a backward others stored alike; else an error)."""
        node, want = self.plan.nodes[self.cursor], self.reads.get(self.cursor, ())
        if op != node.op or not call_fits(want, self.params, args, kwargs):
            got = call_reads(self.params, args, kwargs or {})
            if op != node.op or not (self.backward_seen and alike(self.plan, want, got)):
                if self.no_recompute and checkpoint_calls():  # (torch's checkpoint preamble)
                    self._refuse_checkpointed(self.cursor)
                raise plan_mismatch(node, op, got, did, self.backward_seen)
        if self.cursor == self.start:
            self.run = object()  # (this run of the plan: what its seeded AllReduces carry)
            if self.buffer_made:  # (a later pass reads them whole: `Leaving.store_buffers`)
                self._paused_call(self.store_buffers)
            self.first_op()
            self.moved.clear()
            if self.on_start is not None:
                self._paused_call(self.on_start)
        self.cursor += 1
