"""Capture's recorders: what turns one run on fake tensors into `Node`s.

- `record_kind` (`_call_kinds`'s): how a torch-level call is treated (skipped, a value read,
  the train step's ``backward()``, an alias of its input, or an op); the plan executor asks it
  too.
- `_State`: what the recorders share during one capture: the value each tensor is (`ref`:
  an unknown tensor becomes a constant), the module path stack, the nodes so far (`add_node`:
  one `Node` with its name, inputs, outputs, aten program, source line and op-form strategy).
- `_Recorder`: the ``TorchFunctionMode`` making one node per torch-level call (a constant
  runs as its value on this process's first rank: `_consts.one_values`); it raises
  `CaptureError` at a value read, a data-dependent output shape or a differentiation
  `_mid_step` refuses (a torch.func transform, an op on a gradient it cannot plan), and
  `_StopCapture` at ``backward()``; a call returning its input object unchanged returns a
  view (`_in_place.apart`); a call with ``out=`` tensors is the node of its result, which they
  hold (`_out_calls`); a reset or scaling of a real parameter's ``.grad`` before the first
  node (an optimizer's ``zero_grad(set_to_none=False)`` at the step's start) is no node
  (`_is_grad`).
  The aten ops each call runs are listed by `_aten_recorder.AtenRecorder` (a dispatch mode
  under it), which refuses TorchScript's aten ops (no torch-level call runs them).
- ``_module_hooks``: global module hooks giving each node its module path, recording a
  shardwise primitive as one node (its inner calls unrecorded) and the op-form ``sw.shard``
  strategies of the modules being run (`_op_form_calls.annotation`: the call of such a
  module's forward that takes it, not its hooks' calls).
- `dtype_name` / `info_of`: a tensor's dtype name, shape and dtype as `TensorInfo`;
  `tensors_in`: a pytree's tensors; `_tensors`: those and the tree with `TensorSlot`s in their
  place; the error messages name the user's ``file:line`` (`_source_lines`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from shardwise._torch import pytree
from shardwise._torch.checkpointing import in_activation_checkpoint, nested_checkpoint
from shardwise._torch.fake import DATA_DEPENDENT
from shardwise.ops import _flat as flat
from shardwise.planner._call_kinds import (
    call_name,
    creates_graph,
    keeps_graph,
    reads_size,
    record_kind,
    resets_each_element,
)
from shardwise.planner._consts import one_values
from shardwise.planner._functions import function_of
from shardwise.planner._graph import (
    AtenArg,
    AtenCall,
    Node,
    Ref,
    SizeRead,
    TensorInfo,
    TensorSlot,
)
from shardwise.planner._in_place import apart, call_writes
from shardwise.planner._mid_step import MidStepGradients, functional_refused, transform_refused
from shardwise.planner._op_form_calls import Annotated, annotation
from shardwise.planner._out_calls import out_tensors, record_out
from shardwise.planner._regions import RegionNotes
from shardwise.planner._source_lines import (
    NO_CAPTURE,
    captured_note,
    data_dependent,
    fake_kernel,
    fake_kernel_refused,
    library_read,
    read_name,
    source_line,
)

T = torch.Tensor


class _StopCapture(BaseException):
    """Raised at a train step's ``backward()``: capture ends there (the optimizer step and
    whatever follows are not run on fake tensors)."""


class CaptureError(ValueError):
    """The network does something capture cannot follow (a value read, a data-dependent
    shape); the message names the op, its source line and what to do instead."""


class FakeKernelError(CaptureError, RuntimeError):
    """A call whose meta (fake-tensor) kernel raised during the capture: torch's RuntimeError
    (code catching that still does), named with the call's line and the fix."""


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def info_of(t: T) -> TensorInfo:
    """A tensor's global shape and dtype."""
    return TensorInfo(tuple(map(int, t.shape)), dtype_name(t.dtype))


def _short(op: str) -> str:
    return op.rsplit(".", 1)[-1].strip("_") or op


_SIZE_READS = 20_000  # (shape reads noted at most: `Graph.size_reads`)


class _State:
    """What the recorders share while one capture runs."""

    def __init__(
        self, names: dict[int, Ref], modules: dict[int, str], grads: dict[int, T] | None = None
    ) -> None:
        self.known: dict[int, Ref] = dict(names)  # tensor id -> the value it is
        self.grads = grads or {}  # the real parameters' ``.grad`` tensors: `_is_grad`
        self.keep: list[T] = []  # every recorded tensor, so that no id is reused
        self.gradients = MidStepGradients()  # those no op may read (`_mid_step`)
        self.modules = modules  # module id -> path
        self.stack: list[str] = []
        self.nodes: list[Node] = []
        self.consts: list[TensorInfo] = []
        self.counts: dict[str, int] = {}
        self.inside_primitive = 0
        self.done = False  # capture has ended: nothing more is recorded
        self.aten: list[AtenCall] | None = None  # the running node's aten program
        self.aten_ids: dict[int, AtenArg] = {}
        self.tmp = 0
        self.backward_roots: list[Ref] = []
        self.all_roots_known = False
        self.annotated: list[Annotated] = []  # the op-form ``sw.shard`` modules being run
        self.functions: dict[int, str] = {}  # node -> the custom autograd.Function whose
        # forward ran it (`_functions.function_of`)
        self.regions = RegionNotes()  # activation-checkpointed regions
        self.calls = 0  # torch-level calls running (an aten op outside all: `_aten_recorder`)
        self.running: list[torch.nn.Module] = []  # the modules whose forward runs
        self.refused: CaptureError | None = None  # (raised inside TorchScript: re-raised)
        self.size_reads: list[SizeRead] = []  # (`Graph.size_reads`)
        self.sizes_seen: set[tuple[int, Ref]] = set()

    def ref(self, t: T) -> Ref:
        found = self.known.get(id(t))
        if found is not None:
            return found
        ref = Ref("const", len(self.consts))
        self.consts.append(info_of(t))
        self._remember(t, ref)
        return ref

    def note_size(self, t: Any) -> None:
        """Note that Python code read the shape of `t` (once per value between two nodes; not
        of a tensor that is no value of the graph)."""
        ref = self.known.get(id(t)) if isinstance(t, T) else None
        if ref is None or (len(self.nodes), ref) in self.sizes_seen:
            return
        if len(self.size_reads) >= _SIZE_READS:
            return
        self.sizes_seen.add((len(self.nodes), ref))
        self.size_reads.append(SizeRead(len(self.nodes), ref, source_line()))

    def _remember(self, t: T, ref: Ref) -> None:
        self.known[id(t)] = ref
        self.keep.append(t)

    def name(self, op: str) -> str:
        module = self.stack[-1] if self.stack else ""
        base = f"{module}/{_short(op)}" if module.strip(".") else _short(op)
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def add_node(
        self,
        op: str,
        target: Any,
        ins: Sequence[T],
        outs: Sequence[T],
        template: tuple[tuple[Any, ...], dict[str, Any]] = ((), {}),
        aten: Sequence[AtenCall] = (),
        out_map: Sequence[AtenArg | None] = (),
        saved_before: int | None = None,
    ) -> None:
        """Record node `op` (`saved_before`: `RegionNotes.saved_before` of its run)."""
        index = len(self.nodes)
        if in_activation_checkpoint() and nested_checkpoint():
            raise CaptureError(
                f"{op} at {source_line()} runs inside a checkpointed region inside another "
                f"(nested torch.utils.checkpoint), which AutoParallel does not support; "
                f"checkpoint the regions one after the other"
            )
        strategy = annotation(self.annotated, self.stack, op)
        node = Node(
            index=index,
            name=self.name(op),
            op=op,
            module=self.stack[-1] if self.stack else "",
            inputs=tuple(self.ref(t) for t in ins),
            outputs=tuple(info_of(t) for t in outs),
            args=template[0],
            kwargs=template[1],
            aten=tuple(aten),
            out_map=tuple(out_map),
            source=source_line(),
            target=target,
            strategy=strategy,
        )
        self.nodes.append(node)
        self.regions.note(index, saved_before)
        for j, t in enumerate(outs):
            self._remember(t, Ref("node", index, j))
        if not torch.is_grad_enabled():  # (a Function's forward runs without gradients)
            function = function_of()
            if function:
                self.functions[index] = function


def _is_param(s: _State, args: tuple[Any, ...]) -> bool:
    """Whether a call's first argument is one of the network's parameters (``requires_grad_``
    on it changes the `Parameter`, not a value: freezing a layer inside the step is no node,
    the parameter is read as before, and the run checks it at the forward's start)."""
    ref = s.known.get(id(args[0])) if args and isinstance(args[0], T) else None
    return ref is not None and ref.kind == "param"


def _is_grad(s: _State, func: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> bool:
    """Whether a call resets or scales the ``.grad`` of one of the networks' parameters element
    by element (`_call_kinds.resets_each_element`: an optimizer holding them zeroes it before
    the forward, ``zero_grad(set_to_none=False)``). Such a call before the first node is no
    node: whether ``.grad`` exists differs from call to call (None at the first); the run
    passes it unexamined before the forward. Any other op on a ``.grad`` (a norm) is one."""
    if not (args and isinstance(args[0], T) and s.grads.get(id(args[0])) is args[0]):
        return False
    return resets_each_element(call_name(func), args, kwargs or {})


def tensors_in(tree: Any) -> list[T]:
    """The tensors of a pytree, in order."""
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, T)]


def _tensors(tree: Any) -> tuple[list[T], Any]:
    """The tensors of a pytree, in order, and the tree with each one as a `TensorSlot`."""
    tensors: list[T] = []
    if flat.plain(tree):  # (nearly every call: plain containers, walked without pytree)

        def slot(t: T) -> TensorSlot:
            tensors.append(t)
            return TensorSlot(len(tensors) - 1)

        return tensors, flat.map_only(T, slot, tree)
    leaves, spec = pytree.tree_flatten(tree)
    out = []
    for leaf in leaves:
        if isinstance(leaf, T):
            out.append(TensorSlot(len(tensors)))
            tensors.append(leaf)
        else:
            out.append(leaf)
    return tensors, pytree.tree_unflatten(out, spec)


class _Recorder(TorchFunctionMode):
    """Makes one node per torch-level call (see the module docstring)."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.s = state

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.s.calls += 1  # (the aten ops it runs are inside a torch-level call)
        try:
            return self._call(func, args, kwargs or {})
        finally:
            self.s.calls -= 1

    def _call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        s = self.s
        kind = record_kind(func)
        if s.done or s.inside_primitive:
            return func(*args, **kwargs)
        if refused := transform_refused():  # (inside a torch.func transform)
            raise CaptureError(refused)
        if kind == "skip":
            if args and reads_size(func):
                s.note_size(args[0])
            return func(*args, **kwargs)
        if kind == "grad" and (refused := functional_refused()):
            raise CaptureError(refused)  # (torch.autograd.functional.jvp's grads)
        if kind == "grad":
            if keeps_graph(args, kwargs):  # (mid-step, e.g. monitoring: no node; goes on)
                out = func(*args, **kwargs)
                graph = creates_graph(func, args, kwargs)  # (an op reading them is refused)
                s.gradients.note(args, kwargs, out, s.known, s.nodes, graph)
                return out
            kind = "backward"  # (the graph is freed: the step's last differentiation)
        graph_grads = kind == "backward" and creates_graph(func, args, kwargs)
        if graph_grads and func is not torch.autograd.grad:  # (the buckets: plain gradients)
            raise CaptureError(
                f"backward(create_graph=True) at {source_line()}: AutoParallel reduces plain "
                f"parameter gradients, not ones that carry a graph (second derivatives, a "
                f"penalty on p.grad are not supported); drop create_graph=True"
            )
        if kind == "backward":  # the graph ends; the rest of the step is not run on fakes
            first = args[0] if args else kwargs.get("outputs", kwargs.get("tensors"))
            roots = first if isinstance(first, list | tuple) else [first]
            known = [s.known.get(id(r)) if isinstance(r, T) else None for r in roots]
            # (``torch.autograd.backward(tensors)``: each of them; none if one is unknown)
            s.backward_roots = [r for r in known if r is not None]
            s.all_roots_known = None not in known
            s.done = True
            raise _StopCapture
        if func is torch.Tensor.requires_grad_ and _is_param(s, args):
            return func(*args, **kwargs)  # (no node: the Parameter's flag, as between calls)
        if (
            s.grads and not s.nodes and _is_grad(s, func, args, kwargs)
        ):  # (no node; as a constant runs)
            args, kwargs = one_values(args, kwargs, [args[0]])
            return func(*args, **kwargs)
        if kind == "alias":
            out = func(*args, **kwargs)
            if isinstance(args[0], T) and id(args[0]) in s.known and out is not args[0]:
                s.known[id(out)] = s.known[id(args[0])]
                s.keep.append(out)
            if args and out is not args[0]:
                s.gradients.alias(args[0], out)
            return out
        if kind == "read":
            inside = library_read()
            raise CaptureError(
                f"{read_name(str(resolve_name(func) or func))} at {source_line()} reads a "
                f"tensor's value while the "
                f"network is captured (fake tensors have no values)"
                + (
                    inside
                    or "; keep values out of the forward (log the loss after loss.backward(), "
                    "use torch.where instead of Python if on a tensor, a fixed capacity per "
                    "part instead of sizes read from a tensor (torch.split(x, counts.tolist())))"
                    + NO_CAPTURE
                )
            )
        return self._record(func, args, kwargs)

    def _record(self, func: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        s = self.s
        given = out_tensors(kw)
        if given:  # (``torch.cumsum(x, 1, out=c)``: the op's result, stored in c)
            return record_out(self._record, s, func, (args, kw), given)
        if func is torch.Tensor.__deepcopy__:  # (storage copies do not run on fake tensors)
            raise CaptureError(
                f"copy.deepcopy of a tensor at {source_line()} runs while the step is captured "
                "(on fake tensors, which it cannot copy); copy it with t.detach().clone()"
            )
        ins, template = _tensors((args, kw))
        if s.gradients.refused and (refused := s.gradients.check(func, ins)):
            raise CaptureError(refused)
        if any(id(t) not in s.known for t in ins):  # (constants: each as one value)
            args, kw = one_values(args, kw, [t for t in ins if id(t) not in s.known])
            ins, template = _tensors((args, kw))
        s.aten, s.aten_ids, s.tmp = [], {}, 0
        for i, t in enumerate(ins):
            s.aten_ids.setdefault(
                id(t), AtenArg("in", i, info_of(t), tuple(t.stride()), int(t.storage_offset()))
            )
        op = call_name(func)
        saved = s.regions.saved_before()
        try:
            out = func(*args, **kw)
        except DATA_DEPENDENT as e:
            raise CaptureError(data_dependent(op, e)) from None
        except RuntimeError as e:  # (torch's own: a meta kernel's check is named with the fix)
            kernel = fake_kernel(e)
            if kernel is None:
                e.add_note(captured_note(op))
                raise
            raise FakeKernelError(fake_kernel_refused(op, kernel, e)) from e
        finally:
            aten, ids = s.aten, s.aten_ids
            s.aten = None
        outs = tensors_in(out)
        if ins or outs:  # (not a call on Python state only, such as torch.set_grad_enabled)
            out_map = [ids.get(id(t)) for t in outs]
            if any(a is not None and a.kind == "in" for a in out_map):  # (``h.float()``)
                out = apart(out, ins) if not call_writes(op, kw, aten or ()) else out
                outs = tensors_in(out)
            s.add_node(op, func, ins, outs, template, aten or (), out_map, saved)
        return out
