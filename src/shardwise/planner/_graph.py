"""The captured op graph: every op of one forward (or train step), with its dataflow edges.

- `TensorInfo`: a value's global shape and dtype.
- `Ref`: where a node's tensor input comes from (a graph input, a parameter, a buffer, another
  node's output, or a constant made outside the graph).
- `AtenCall`: one aten op a torch-level op dispatched to, with its arguments; the sharding
  rules are queried per aten op.
- `Node`: one op as the user's code called it (a ``torch.nn.functional`` function, a ``Tensor``
  method, a factory, or a shardwise primitive as a whole), named by its module path.
- `SizeRead`: Python code reading a value's shape between two nodes (``x.shape[0]``).
- `Graph`: the nodes in execution order, the inputs, parameters and outputs.

Everything is global (unsharded) metadata; no tensor data is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from shardwise.planner._regions import Region

Shape = tuple[int, ...]
RefKind = Literal["input", "param", "buffer", "node", "const"]


@dataclass(frozen=True)
class TensorInfo:
    """A value's global shape and dtype (``"float32"``, ``"int64"``, ...)."""

    shape: Shape
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Ref:
    """Where a tensor comes from.

    Attributes:
        kind: ``"input"`` (key: the input's path, e.g. ``"args[0]"``, ``"kwargs['labels']"``),
            ``"param"`` / ``"buffer"`` (key: the qualified name), ``"node"`` (key: the node
            index, `index`: which output), ``"const"`` (key: its number in `Graph.consts`).
        key: see `kind`.
        index: the output of a node.
    """

    kind: RefKind
    key: str | int
    index: int = 0

    def __str__(self) -> str:
        if self.kind == "node":
            return f"%{self.key}" + (f".{self.index}" if self.index else "")
        return f"{self.kind}:{self.key}"


class SizeRead(NamedTuple):
    """Python code reading a value's shape (``x.shape``, ``x.size(0)``, ``len(x)``,
    ``x.numel()``) while the call was captured.

    Attributes:
        before: how many nodes were recorded before it (it ran before node `before`).
        value: the value whose shape it read.
        source: ``file:line`` of the code reading it.
    """

    before: int
    value: Ref
    source: str


@dataclass(frozen=True)
class AtenCall:
    """One aten op inside a node.

    Attributes:
        op: the overload (``torch.ops.aten.view.default``).
        args / kwargs: its arguments with each tensor replaced by an `AtenArg`.
        outputs: which of its outputs are tensors, each as an `AtenArg` ``("tmp", k)``.
    """

    op: Any
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    outputs: tuple[Any, ...]


@dataclass(frozen=True)
class AtenArg:
    """A tensor inside a node's aten program: ``("in", i)`` the node's i-th tensor input,
    ``("tmp", k)`` the k-th tensor the program produced. `info`: its global metadata;
    `stride`: its global stride; `offset`: its storage offset on one device (a view such as
    ``x[2:]`` starts inside its base's storage, at a nonzero offset)."""

    kind: Literal["in", "tmp"]
    index: int
    info: TensorInfo
    stride: tuple[int, ...]
    offset: int = 0


@dataclass(frozen=True)
class Node:
    """One op of the graph.

    Attributes:
        index: its position in execution order.
        name: unique, ``<module path>/<op>`` (``"transformer.h.0.attn/view_1"``).
        op: the op's qualified name (``"torch.Tensor.view"``, ``"torch.nn.functional.linear"``,
            ``"shardwise.ops.MatMul"``).
        module: the module path it ran in (``""``: the top level).
        inputs: its tensor inputs, in the order they appear in its arguments.
        outputs: its tensor outputs.
        args / kwargs: the call's arguments with each tensor replaced by its input position
            (an `int` wrapped in `TensorSlot`); for display and for local arguments.
        aten: the aten ops it ran (empty for a primitive).
        out_map: for each output, which `AtenArg` of the program it is (``("in", i)`` when
            the op returned an input, e.g. ``contiguous`` on a contiguous tensor).
        source: ``file:line`` of the user's code that called it.
        target: the callable (the torch function, or the primitive module); not compared.
        strategy: the op-form ``sw.shard`` strategy of the module that made this op (one entry
            per tensor input: int tuples or layouts), or None.
        function: the custom ``torch.autograd.Function`` whose forward ran it (its class name;
            empty: none), whose own backward the plan must not put collectives around
            (`_functions`).
    """

    index: int
    name: str
    op: str
    module: str
    inputs: tuple[Ref, ...]
    outputs: tuple[TensorInfo, ...]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    aten: tuple[AtenCall, ...] = ()
    out_map: tuple[AtenArg | None, ...] = ()
    source: str = ""
    target: Any = field(default=None, compare=False, repr=False)
    strategy: tuple[Any, ...] | None = None
    function: str = ""

    @property
    def is_primitive(self) -> bool:
        """Whether the node is a shardwise primitive (planned by its own rule)."""
        return self.op.startswith("shardwise.ops.")

    def __str__(self) -> str:
        ins = ", ".join(str(r) for r in self.inputs)
        outs = ", ".join(str(o) for o in self.outputs)
        return f"%{self.index} {self.name} = {self.op}({ins}) -> {outs}"


OP_STRATEGY = "_shardwise_op_strategy"  # the attribute `sw.shard`'s op form sets on a module


def op_strategy(module: Any) -> tuple[Any, ...] | None:
    """The op-form strategy ``sw.shard`` set on `module` (None: none)."""
    found: tuple[Any, ...] | None = getattr(module, OP_STRATEGY, None)
    return found


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor argument sat in a call: the node's `slot`-th tensor input."""

    slot: int

    def __repr__(self) -> str:
        return f"<t{self.slot}>"


@dataclass(frozen=True)
class Graph:
    """Every op of one forward or train step.

    Attributes:
        nodes: in execution order.
        inputs: each tensor input's path and metadata (``"args[0]"``, ``"kwargs['labels']"``).
        params / buffers: name -> metadata, for those the graph uses.
        consts: metadata of tensors made outside the graph (closure constants).
        outputs: the returned tensors (and the train step's backward roots).
        tied: parameter name -> the name it is tied to (shared weights).
        roots: the tensors the train step's ``backward`` (or last ``torch.autograd.grad``)
            started from, in the call's order (empty when one of them is no value of the
            graph).
        regions: the activation-checkpointed regions, in order (`_regions.Region`).
        frozen: the parameters that need no gradient (``requires_grad`` False), in parameter
            order.
        set_buffers: each buffer the call re-assigned (``self.rm = 0.9 * self.rm + ...``) ->
            the node output it holds after the call.
        size_reads: the shapes of values the call's Python code read, in order (each value
            once between two nodes): what its branches may depend on, for the error when a
            rank's call runs other ops than the plan (`parallel/_errors.py`).
    """

    nodes: tuple[Node, ...]
    inputs: Mapping[str, TensorInfo]
    params: Mapping[str, TensorInfo]
    buffers: Mapping[str, TensorInfo]
    consts: tuple[TensorInfo, ...]
    outputs: tuple[Ref, ...]
    tied: Mapping[str, str] = field(default_factory=dict)
    roots: tuple[Ref, ...] = ()
    regions: tuple[Region, ...] = ()
    frozen: tuple[str, ...] = ()
    set_buffers: Mapping[str, Ref] = field(default_factory=dict)
    size_reads: tuple[SizeRead, ...] = field(default=(), compare=False)

    def info(self, ref: Ref) -> TensorInfo:
        """The metadata of the value `ref` names."""
        if ref.kind == "node":
            return self.nodes[int(ref.key)].outputs[ref.index]
        tables: dict[str, Mapping[Any, TensorInfo]] = {
            "input": self.inputs,
            "param": self.params,
            "buffer": self.buffers,
            "const": dict(enumerate(self.consts)),
        }
        return tables[ref.kind][ref.key]

    def consumers(self) -> dict[Ref, list[tuple[int, int]]]:
        """Each value -> the (node index, input position) pairs that read it."""
        out: dict[Ref, list[tuple[int, int]]] = {}
        for node in self.nodes:
            for i, ref in enumerate(node.inputs):
                out.setdefault(ref, []).append((node.index, i))
        return out

    def __len__(self) -> int:
        return len(self.nodes)

    def __str__(self) -> str:
        lines = [f"Graph: {len(self.nodes)} ops, {len(self.params)} parameters"]
        lines += [f"  input {k}: {v}" for k, v in self.inputs.items()]
        lines += [f"  {n}" for n in self.nodes]
        lines.append("  return " + ", ".join(str(r) for r in self.outputs))
        if self.roots:
            lines.append("  backward from " + ", ".join(str(r) for r in self.roots))
        return "\n".join(lines)
