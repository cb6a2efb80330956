"""Passes of one plan within a wrapped call: where a later pass starts (`Passes`, mixed into
`_executor.PlanExecutor`).

A train step may run its network more than once: gradient accumulation, an optimizer's closure.
The plan is captured up to the first ``loss.backward()``; after a backward, a call that starts
the plan again (`Passes._restarts`) moves the cursor back to a node up to where the first pass
entered the network (`Passes.network_entered`): the first whose op and parameters the call has
and whose inputs no op outside the plan made (the node where it entered the network only once
the network is called again: a WGAN's ``p.data.clamp_`` after the optimizer's step is no pass
of a network whose first op is ``p.data``). The ops before it run once (``total =
torch.zeros(())``, ``x.chunk(k)`` of the whole batch); those from it again in every pass (a
per-micro-batch ``x - x.mean(0)`` before the network included). A pass only factories started
(``torch.zeros(())`` for logging after the last backward) is dropped at the first op that is
not the plan's next (`Passes.abandon`).

An op after a backward that starts no pass runs outside the plan, on this rank's blocks: its
results are *made outside* (`Passes.note_outside`), except those of elementwise ops on tensors
not made outside (``x * 0.5``, ``detach``, ``to``: right on this rank's blocks); an in-place op
marks the tensor it changes, parameters excepted (an optimizer's update). Refused with
`UnsupportedParallelError`, never run unplanned: a network entered again whose first tensor op
starts no pass (`Passes._refuse_pass`), and any op of a later pass that reads a tensor made
outside (`Passes.check_inputs`: on one rank's rows, without the plan's collectives and masks).
A later pass steps over the plan's nodes that made a tensor from nothing and that it does not
call (`Passes.skip_made`: a lazy init the first pass ran, ``torch.amp.GradScaler``'s
``torch.full`` scale on its first ``scale``); the pass reads the tensors the first pass made.
A backward before the pass reached the plan's last op is refused too (`Passes.check_done`), and
an op outside the plan that fails on a parameter optimizer parallel holds as this rank's shard,
or on a value the plan holds whole that leaves the call as this rank's rows, gets a note naming
it and the fix (`Passes.run_outside`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from shardwise._torch import pytree
from shardwise._torch.storage import view_base
from shardwise.parallel._errors import Replan, UnsupportedParallelError
from shardwise.planner import EdgePlan, ParallelPlan
from shardwise.planner._in_place import in_place

T = torch.Tensor


_ELEMENTWISE = {  # (on this rank's blocks each gives its block of the whole result)
    *("detach", "clone", "contiguous", "to", "float", "double", "half", "bfloat16", "long"),
    *("int", "bool", "cpu", "cuda", "requires_grad", "type_as", "data", "real", "imag"),
    *("add", "sub", "mul", "div", "true_divide", "neg", "abs", "exp", "log", "sqrt", "rsqrt"),
    *("sigmoid", "tanh", "relu", "clamp", "clip", "pow", "square", "reciprocal", "sign"),
    *("radd", "rsub", "rmul", "truediv", "rtruediv", "pow", "rpow"),
}


def _elementwise(op: str) -> bool:
    """Whether `op` (``torch.Tensor.mul_``, ``torch.add``, ``torch.Tensor.__rtruediv__``, an
    attribute's getter: ``torch.Tensor.data.__get__``) is an elementwise op of `_ELEMENTWISE`."""
    return op.removesuffix(".__get__").rsplit(".", 1)[-1].strip("_") in _ELEMENTWISE


def _held(made: dict[int, weakref.ref[T]], t: Any) -> bool:
    if not isinstance(t, T):
        return False
    ref = made.get(id(t))
    return ref is not None and ref() is t


class Passes:
    """Where a later pass starts (see the module docstring); `PlanExecutor` sets the
    attributes."""

    plan: ParallelPlan
    cursor: int
    finished: bool
    outside: bool
    start: int
    network_start: int | None
    reentered: bool
    made_outside: dict[int, weakref.ref[T]]  # tensors ops outside the plan made (by id)
    inputs: dict[int, weakref.ref[T]]  # the call's inputs and elementwise results of them
    tentative: int  # a restarted pass is dropped on a mismatch up to this node (`abandon`)
    in_network: bool  # the network was entered for the running pass
    backward_seen: bool
    param_value: Any  # (optimizer parallel's compute weight of a parameter, else None)

    if TYPE_CHECKING:

        @property
        def params(self) -> dict[int, str]: ...

        @property
        def done(self) -> bool: ...

        def _ended(self) -> None: ...

        def check_placed(self, op: str, args: Any, out: Any) -> None: ...

        def _held(self, t: Any) -> tuple[EdgePlan, str] | None: ...

    def skip_made(self, op: str) -> None:
        """In a later pass, when `op` is not the plan's next node but the node after a run of
        nodes that made a tensor from nothing (no inputs: a lazy init that only the first pass
        ran), step over that run: this pass reads the tensors the first one made."""
        nodes, j = self.plan.nodes, self.cursor
        if not self.backward_seen or j >= len(nodes) or nodes[j].op == op:
            return
        while j < len(nodes) and not nodes[j].values and nodes[j].op != op:
            j += 1
        if j < len(nodes) and j > self.cursor and nodes[j].op == op:
            self.cursor = j

    def check_done(self, where: str) -> None:
        """Raise when `where` (a backward) comes before the plan's last op ran: another plan
        is made before any backward of the call (`Replan`), an error after one. In a later
        pass the plan's last nodes may be factories it does not call (`skip_made`)."""
        nodes = self.plan.nodes
        if self.backward_seen and not self.done and not any(n.values for n in nodes[self.cursor :]):
            self.cursor = len(nodes)  # (nothing left but factories the first pass ran)
            self._ended()
        if not self.done and self.cursor:
            node = self.plan.nodes[self.cursor]
            if not self.backward_seen:
                raise Replan(f"{where} before %{node.index} {node.name}", self.cursor, None)
            raise UnsupportedParallelError(
                f"AutoParallel: {where} came after {self.cursor} of the plan's "
                f"{len(self.plan.nodes)} ops (next: %{node.index} {node.name}); the step must "
                f"run the captured ops every time"
            )

    def _restarts(self, op: str, args: Any) -> bool:
        """After the plan ran and a backward: whether this call starts it again (gradient
        accumulation, an optimizer's closure; see the module docstring), with the same
        parameters in the same places (other inputs may differ: a scaled batch, another
        chunk)."""
        if not self.finished or not self.plan.nodes:
            return False
        leaves = pytree.tree_leaves(args)
        if any(_held(self.made_outside, t) for t in leaves):
            return False
        bound = self.network_start  # (None: the step calls submodules, never the network)
        if bound is None:  # (then up to the first op that reads a parameter)
            nodes = self.plan.nodes
            reads = (
                j for j, n in enumerate(nodes) if any(v.startswith("param:") for v in n.values)
            )
            bound = next(reads, 0)
        for start in range(bound + 1):
            if start == self.network_start and not self.reentered:
                continue  # (the network's first op after the step, not in it: ``p.data``)
            if self._starts_with(start, op, leaves):
                self.cursor, self.finished, self.outside = start, False, False
                self.start, self.in_network, self.reentered = start, self.reentered, False
                nodes = self.plan.nodes
                first_read = next((j for j in range(start, len(nodes)) if nodes[j].values), start)
                self.tentative = first_read  # (a pass started by factories: `abandon`)
                return True
        return False

    def abandon(self, op: str) -> bool:
        """Whether `op`, not the plan's next one, ends a pass that only factories started and
        that did not enter the network (a ``torch.zeros(())`` for logging after the last
        backward looked like the plan's first op): the pass is dropped, and `op` runs outside
        the plan. False: a real mismatch."""
        if not self.backward_seen or self.cursor > self.tentative or self.in_network:
            return False  # (a real pass: the network was entered for it)
        self.cursor, self.finished, self.outside = len(self.plan.nodes), True, True
        self._ended()  # (the forward's end: level 3's saved-weight tokens stop)
        return True

    def note_outside(self, op: str, args: Any, out: Any) -> None:
        """An op that ran outside the plan (after a backward) made `out` from `args` (one
        reading a value the plan holds other than it leaves the call: `_leaving`)."""
        self.check_placed(op, args, out)
        if not isinstance(out, T) or id(out) in self.params:
            return
        leaves = pytree.tree_leaves(args)
        if not _elementwise(op) or any(_held(self.made_outside, t) for t in leaves):
            self.made_outside[id(out)] = weakref.ref(out)
        elif any(_held(self.inputs, t) for t in leaves):  # (``x * 0.5``: stands for an input)
            self.inputs[id(out)] = weakref.ref(out)

    def run_outside(self, func: Any, op: str, args: Any, kwargs: Any) -> Any:
        """Run `op` outside the plan; when it fails reading a parameter the plan stores as a
        block (`_param_note`) or a value the plan holds whole that leaves the call as this
        rank's rows (`_whole_note`), torch's error gets a note naming it and the fix."""
        try:
            return func(*args, **kwargs)
        except (RuntimeError, IndexError, ValueError) as e:  # (embedding on a shard: IndexError)
            leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, T)]
            note = self._param_note(op, leaves) or self._whole_note(op, leaves)
            if note is not None:
                e.add_note(note)
            raise

    def _param_note(self, op: str, leaves: list[T]) -> str | None:
        """The note for a computation (not an in-place update: an EMA's ``lerp_``) outside the
        plan that read a parameter the plan stores split (an operator-level block) or optimizer
        parallel stores as this rank's shard (a GAN's ``D(fake)`` after ``d_loss.backward()``:
        no pass of the plan starts there, so the weight is not gathered); None for others."""
        roots = [view_base(t) for t in leaves]  # (``w.t()``: a view of w)
        bases = [t if root is None else root for t, root in zip(leaves, roots, strict=True)]
        names = [self.params[id(t)] for t in bases if id(t) in self.params]
        stored = self.plan.params
        split = [n for n in names if n in stored and stored[n].layout.used_axes()]
        if in_place(op) or not (split or (self.param_value is not None and names)):
            return None
        name = split[0] if split else names[0]
        holds = (
            f"the plan stores it split over the ranks ({stored[name].layout}), so it "
            f"holds this rank's block there"
            if split
            else "with hsdp() the parameter holds this rank's shard there"
        )
        fix = "keep it whole (annotate its op)" if split else "train without hsdp()"
        return (
            f"AutoParallel: {op} reads {name} after loss.backward(), outside the plan "
            f"(no pass of the plan starts there: only the network's own ops from where "
            f"the first pass entered it run again), and {holds}; run every forward "
            f"before the first backward (a GAN: D(real), D(fake.detach()) and D(fake), "
            f"then the backwards), or {fix}"
        )

    def _whole_note(self, op: str, leaves: list[T]) -> str | None:
        """The note for an op outside the plan that read a value the plan holds whole but that
        leaves the call as this rank's rows (a target made before the backward from the
        whole batch's size, ``torch.ones(x.shape[0], 1) * 0.9``), where the values made outside
        the plan are this rank's rows; None when it read none."""
        for t in leaves:
            held = self._held(t)
            if held is None or held[0].src.partial or held[0].src.layout.used_axes():
                continue
            edge, node = held
            return (
                f"AutoParallel: {op} after loss.backward() reads the output of {node}, which "
                f"the plan holds whole ({list(edge.shape)}: every row of the batch), while an "
                f"op outside the plan computes on this rank's rows "
                f"({list(edge.dst.local_shape(edge.shape))}); make it from this rank's "
                f"tensors after the backward (torch.ones_like(d_out)), or run the op before "
                f"the first backward (the plan then includes it)"
            )
        return None

    def check_inputs(self, op: str, args: Any) -> None:
        """Refuse an op of the plan that reads a tensor made outside the plan (on this rank's
        rows only, without the plan's collectives and masks)."""
        if any(_held(self.made_outside, t) for t in pytree.tree_leaves(args)):
            k = self.cursor
            node = self.plan.nodes[k] if k < len(self.plan.nodes) else None
            where = f"the plan's %{k} {node.name}" if node is not None else "a new pass"
            raise UnsupportedParallelError(
                f"AutoParallel: {op} ({where}) reads a tensor that an op the plan does "
                f"not have made after loss.backward() (outside the plan, so on this rank's rows "
                f"only); every pass must run the ops of the first from where it starts"
            )

    def _starts_with(self, k: int, op: str, leaves: list[Any]) -> bool:
        """Whether a call of `op` on `leaves` is node `k`'s: the same parameters in its places,
        the call's inputs where it read inputs (not a value made in the step there)."""
        node = self.plan.nodes[k]
        if op != node.op:
            return False
        tensors = [t for t in leaves if isinstance(t, T)]
        if len(tensors) != len(node.values):
            return False
        for t, value in zip(tensors, node.values, strict=True):
            name = self.params.get(id(t))
            if (name is not None or value.startswith("param:")) and value != f"param:{name}":
                return False
            if value.startswith("input:") != _held(self.inputs, t):  # (an input's place)
                return False
        return True

    def _refuse_pass(self, op: str, args: Any) -> None:
        """Raise: the network was entered again, but `op` on `args` starts no pass of the
        plan (or reads a tensor made outside it)."""
        self.check_inputs(op, args)
        nodes = self.plan.nodes
        where = [f"%0 {nodes[0].name} ({nodes[0].op})"]
        if self.network_start:
            k = self.network_start
            where.append(f"%{k} {nodes[k].name} ({nodes[k].op}), where it entered the network")
        raise UnsupportedParallelError(
            f"AutoParallel: the network was called again after loss.backward() (gradient "
            f"accumulation, a closure), but its first op {op} is not the plan's "
            f"{' or '.join(where)}: every pass must run the ops of the first (plan another "
            f"step for another network, or call it in a separate wrapped call)"
        )

    def network_entered(self) -> None:
        """The network's forward begins: the node the first pass was at when it did is where a
        later pass may start again (`_restarts`)."""
        if self.finished:
            self.reentered = True
        elif self.network_start is None:
            self.network_start = self.cursor
        else:
            self.in_network = True  # (this pass entered it: not one to `abandon`)
        super().network_entered()  # type: ignore[misc]
