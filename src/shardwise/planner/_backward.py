"""Equal gradients: where a plan makes the gradient of a replicated value the same on every
replica (Megatron's ``f``), so that adjoints of forward AllReduces and replicated parameters'
gradients need no collective over that axis (`plan_backward`, the last step of
`plan_semi_auto`).

shardwise differentiates the mean of every rank's copy of the step, so the gradient a rank holds
for a value replicated over a device axis is its *share* of that value's gradient: the shares
add up over the replicas. The adjoint of a forward AllReduce is therefore an AllReduce (the
shares summed), and a replicated parameter's gradient is all-reduced over every axis it is
replicated on. When every replica's share is the same (an *equal* gradient), the sum is the
share times the replicas, computed locally. Megatron's layout makes the gradient equal where a
replicated value meets ops split over the axis (the column-parallel q / k / v, fc1, head): one
AllReduce(avg) of the gradient there; then the adjoints of the AllReduces that made the value
replicated (the row-parallel wo and fc2, a vocabulary-parallel embedding) and the gradients of
the replicated parameters in between (LayerNorms, positions) need nothing over that axis.

For each device axis, `_Axis`:

1. `_Axis.link`: groups the floating-point values replicated over the axis into regions, linked
   through the ops that run alike on every replica (every input and output replicated over the
   axis, no collective over it); a value read by any other op (or moved off the axis first)
   gets a share that differs between replicas: an *exit*;
2. `_Axis.regions`: per region, the op outputs that are exits (each would get an ``f``), the
   values an AllReduce over the axis made replicated (their adjoint gets local), the parameters
   whose gradient gets equal, and what forbids it: a returned value or a final one (a loss: a
   backward may start there with any seed), an in-place op's output or one that aliases an
   input (the ``f`` would not be on the value the code goes on with), a moved value read by a
   split op;
3. `_Axis.decide`: converts a region when that adds no bytes and no collectives (the ``f``s
   against the saved adjoints and gradient buckets) and saves something.

`plan_backward` returns the nodes with their ``f``s (`NodePlan.backward`) and local adjoints
(`Collective.equal_grad`), the edges with theirs (`EdgePlan.equal_grad`) and each parameter's
equal axes (`ParallelPlan.equal_grads`). Every ``f`` is sound on its own (the shares' sum is
kept); only the local adjoints and buckets rely on the analysis.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner._graph import AtenArg, Graph, Node, Ref
from shardwise.planner._in_place import writes_input
from shardwise.planner._placement import _itemsize
from shardwise.planner._plan import Collective, EdgePlan, NodePlan, Placed

Key = Hashable  # a value: its `Ref`, or (Ref, Placed) for a moved one, or ("op", k) for an op
Where = tuple[str, int, int]  # an AllReduce: ("comm", op, its index) or ("edge", edge, 0)


def _is_float(dtype: str) -> bool:
    return "float" in dtype or "complex" in dtype


@dataclass
class _Region:
    """One region over an axis (see the module docstring)."""

    f: dict[tuple[int, int], int] = field(default_factory=dict)  # op output -> bytes (needs f)
    entries: list[tuple[Where, int, bool]] = field(default_factory=list)  # (where, bytes, saves)
    params: set[str] = field(default_factory=set)
    shared: set[str] = field(default_factory=set)  # parameters a split op reads (unequal)
    blocked: bool = False


@dataclass
class _Found:
    """What the axes decided so far: ``f``s, local adjoints, equal parameters."""

    f: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (op, output) -> axes
    local: dict[Where, set[int]] = field(default_factory=dict)  # AllReduce -> local axes
    params: dict[str, set[int]] = field(default_factory=dict)


class _Values:
    """What every axis reads: the graph, the plan's nodes and edges, values' metadata."""

    def __init__(
        self,
        graph: Graph,
        nodes: Sequence[NodePlan],
        edges: Sequence[EdgePlan],
        params: Mapping[str, TensorLayout],
    ) -> None:
        self.graph, self.nodes, self.edges = graph, nodes, edges
        self.params = params
        self.edge_at = {
            (e.consumer, e.slot): i
            for i, e in enumerate(edges)
            if e.consumer >= 0 and not e.written_back
        }
        self.made_at = {e.value: i for i, e in enumerate(edges) if e.consumer == -1}
        self.mover: dict[tuple[str, Placed], int] = {}  # the edge that moves a value (not shared)
        for i, e in enumerate(edges):
            if e.consumer >= 0 and not e.shared and not e.written_back:
                self.mover.setdefault((e.value, e.dst), i)
        self.returned = set(graph.outputs)
        # values a later op writes into (item assignment, ``x.add_(...)``): their gradient
        # splits there, part of it going to what was written
        self.written = {n.inputs[0] for n in graph.nodes if n.inputs and writes_input(n)}
        self.needs = self._needs()
        self.live = {r for n in graph.nodes for r in n.inputs if self._feeds_grads(n)}

    def _needs(self) -> dict[Ref, bool]:
        """Whether each value may carry a gradient (a float parameter or input, or computed
        from one; buffers and constants carry none)."""
        g = self.graph
        needs = {Ref("param", n): _is_float(i.dtype) for n, i in g.params.items()}
        needs |= {Ref("input", n): _is_float(i.dtype) for n, i in g.inputs.items()}
        for node in self.graph.nodes:
            grad = any(needs.get(r, False) for r in node.inputs)
            for j, info in enumerate(node.outputs):
                needs[Ref("node", node.index, j)] = grad and _is_float(info.dtype)
        return needs

    def _feeds_grads(self, node: Node) -> bool:
        return any(self.needs[Ref("node", node.index, j)] for j in range(len(node.outputs)))

    def is_float(self, ref: Ref) -> bool:
        return _is_float(self.graph.info(ref).dtype)

    def out_placed(self, k: int, j: int) -> Placed:
        """Output `j` of op `k` as its consumers see it (after an AllReduce where it is made)."""
        made = self.made_at.get(str(Ref("node", k, j)))
        return self.edges[made].dst if made is not None else self.nodes[k].outputs[j]

    def nbytes(self, ref: Ref, placed: Placed) -> int:
        info = self.graph.info(ref)
        return math.prod(placed.local_shape(info.shape)) * _itemsize(info.dtype)

    def final(self, k: int) -> bool:
        """Whether no output of op `k` feeds an op whose outputs carry gradients (a loss): a
        backward may start at its outputs with any seed."""
        return not any(Ref("node", k, j) in self.live for j in range(len(self.nodes[k].outputs)))

    def can_f(self, k: int, j: int) -> bool:
        """Whether output `j` of op `k` is a new tensor the code goes on with (an ``f`` on it
        reaches every later use): not an alias of an input, not made by writing into one, and
        not written into later (``z = h.clone(); z[:, 1:3] = v``: the ``f`` would reach the
        gradient of the clone's own values, not the part that flows to `v`)."""
        node = self.graph.nodes[k]
        alias = j < len(node.out_map) and isinstance(node.out_map[j], AtenArg)
        alias = alias and node.out_map[j].kind == "in"  # type: ignore[union-attr]
        written = Ref("node", k, j) in self.written
        return not alias and not writes_input(node) and not written


class _Axis:
    """The regions over one device axis and the decision on each (see the module docstring)."""

    def __init__(self, values: _Values, matrix: DeviceMatrix, a: int, found: _Found) -> None:
        self.v, self.matrix, self.a, self.found = values, matrix, a, found
        self.name = matrix.names[a]
        self.parent: dict[Key, Key] = {}
        self.exits: set[Key] = set()  # values a split op reads (their shares differ)
        self.entries: dict[Key, tuple[Where, int, bool]] = {}  # value -> its AllReduce over a
        self.blocked: set[Key] = set()
        self.params: set[Key] = set()
        self.classes: Counter[tuple[int, ...]] | None = None  # parameters per bucket group

    def repl(self, p: Placed) -> bool:
        return self.a not in p.layout.used_axes() and self.a not in p.partial

    def find(self, key: Key) -> Key:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a: Key, b: Key) -> None:
        self.parent[self.find(a)] = self.find(b)

    def uniform(self, n: NodePlan) -> bool:
        """Whether op `n` runs alike on every replica over the axis."""
        if any(self.name in c.axes for c in n.comms):
            return False
        return all(self.repl(p) for p in (*n.inputs, *n.outputs))

    def link(self) -> None:
        """Step 1: every float value replicated over the axis, its region, its exits."""
        for n in self.v.nodes:
            node, uniform = self.v.graph.nodes[n.index], self.uniform(n)
            for s, ref in enumerate(node.inputs):
                if self.v.is_float(ref):
                    self._read(n, s, ref, uniform)
            for j, info in enumerate(node.outputs):
                if _is_float(info.dtype) and self.repl(self.v.out_placed(n.index, j)):
                    self._made(n, j, uniform)

    def _read(self, n: NodePlan, s: int, ref: Ref, uniform: bool) -> None:
        i = self.v.edge_at.get((n.index, s))
        dst = n.inputs[s]
        src = self.v.edges[i].src if i is not None else dst
        key: Key
        if self.repl(src):
            key = ref
            if ref.kind == "param":
                self.params.add(key)
        elif self.repl(dst) and i is not None:  # made replicated over the axis by the move
            key = (ref, dst)
            edge = self.v.edges[i]
            mover = self.v.mover.get((edge.value, dst), i)
            if self.a in edge.reduced:
                self._entry(key, ("edge", mover, 0), ref, dst, edge.reduced)
        else:
            return
        if self.repl(dst) and uniform:
            self.union(key, ("op", n.index))
            return
        self.find(key)
        self.exits.add(key)
        if not isinstance(key, Ref) and self.v.needs.get(ref, False):
            self.blocked.add(key)  # (no `f` on a moved value)

    def _made(self, n: NodePlan, j: int, uniform: bool) -> None:
        key = Ref("node", n.index, j)
        if uniform:
            self.union(key, ("op", n.index))
        else:
            self.find(key)
            placed = self.v.out_placed(n.index, j)
            for ci, c in enumerate(n.comms):
                if c.output == j and c.kind == "AllReduce" and self.name in c.axes:
                    axes = tuple(self.matrix.axis(x) for x in c.axes)
                    self._entry(key, ("comm", n.index, ci), key, placed, axes)
            made = self.v.made_at.get(str(key))
            if made is not None and self.a in self.v.edges[made].reduced:
                reduced = self.v.edges[made].reduced
                self._entry(key, ("edge", made, 0), key, placed, reduced)
        final = self.v.final(n.index) and self.v.needs[key]
        if key in self.v.returned or final:
            self.blocked.add(key)

    def _entry(self, key: Key, where: Where, ref: Ref, placed: Placed, axes: Sequence[int]) -> None:
        """`key` is made replicated over the axis by an AllReduce over `axes` (at `where`): it
        saves a collective when every other of its axes is already local."""
        if not self.v.needs.get(ref, False):
            self.entries[key] = (where, 0, False)
            return
        done = self.found.local.get(where, set())
        saves = all(x == self.a or x in done for x in axes)
        self.entries[key] = (where, self.v.nbytes(ref, placed), saves)

    def regions(self) -> list[_Region]:
        """Step 2: each region's ``f``s, entries, parameters and blockers."""
        out: dict[Key, _Region] = {}
        for key in list(self.parent):
            r = out.setdefault(self.find(key), _Region())
            r.blocked |= key in self.blocked
            if key in self.entries:
                r.entries.append(self.entries[key])
            if key in self.params:
                assert isinstance(key, Ref)
                r.params.add(str(key.key))
                if key in self.exits:
                    r.shared.add(str(key.key))
            if key not in self.exits or not isinstance(key, Ref) or key.kind != "node":
                continue
            k, j = int(key.key), key.index
            needs = self.v.needs[key]
            if not self.v.can_f(k, j):
                r.blocked |= needs
                continue
            r.f[(k, j)] = self.v.nbytes(key, self.v.out_placed(k, j)) if needs else 0
        return list(out.values())

    def _class(self, name: str) -> tuple[int, ...]:
        """The axes parameter `name`'s gradient is summed over (its bucket's group)."""
        layout, equal = self.v.params[name], self.found.params.get(name, set())
        shape = self.matrix.shape
        return tuple(x for x in layout.replicated_axes() if shape[x] > 1 and x not in equal)

    def _buckets(self, equal: set[str]) -> int:
        """How many more gradient buckets (groups of reduction axes) there are when the
        parameters `equal` are not summed over the axis (negative: fewer)."""
        if self.classes is None:
            grads = [n for n in self.v.params if self.v.needs.get(Ref("param", n), False)]
            self.classes = Counter(self._class(n) for n in grads)
        before = Counter(self._class(n) for n in equal)
        after = Counter(tuple(x for x in c if x != self.a) for c in before.elements())
        change = self.classes - before + after
        touched = (set(before) | set(after)) - {()}
        return sum((change[c] > 0) - (self.classes[c] > 0) for c in touched)

    def decide(self, r: _Region) -> bool:
        """Step 3: convert `r` when that adds no bytes and no collectives and saves something."""
        if r.blocked:
            return False
        new_f = sum(1 for kj, b in r.f.items() if b and not self.found.f.get(kj))
        saved = [b for _, b, saves in r.entries if saves]
        equal = r.params - r.shared
        count = new_f - len(saved) + self._buckets(equal)
        extra = sum(r.f.values()) - sum(saved)
        return count <= 0 and extra <= 0 and (count < 0 or extra < 0 or bool(equal))

    def convert(self, r: _Region) -> None:
        for kj in r.f:
            self.found.f.setdefault(kj, set()).add(self.a)
        for where, _, _ in r.entries:
            self.found.local.setdefault(where, set()).add(self.a)
        self.classes = None  # (recounted with the new equal parameters)
        for name in r.params - r.shared:
            self.found.params.setdefault(name, set()).add(self.a)


def plan_backward(
    graph: Graph,
    nodes: Sequence[NodePlan],
    edges: Sequence[EdgePlan],
    params: Mapping[str, TensorLayout],
    matrix: DeviceMatrix,
) -> tuple[tuple[NodePlan, ...], tuple[EdgePlan, ...], dict[str, tuple[int, ...]]]:
    """`nodes` with their ``f``s and local adjoints, `edges` with their local adjoints, and each
    parameter's equal axes (see the module docstring).

    Example:
        >>> nodes, edges, equal = plan_backward(graph, nodes, edges, params, matrix)
        >>> equal  # a Megatron block at 1 x 2: the LayerNorms' gradients need no AllReduce
        {'ln1_gamma': (0,), 'ln1_beta': (0,), ...}
    """
    values, found = _Values(graph, nodes, edges, params), _Found()
    for a, size in enumerate(matrix.shape):
        if size == 1:
            continue
        axis = _Axis(values, matrix, a, found)
        axis.link()
        for region in axis.regions():
            if axis.decide(region):
                axis.convert(region)
    names = matrix.names

    def local(where: Where) -> tuple[int, ...]:
        return tuple(sorted(found.local.get(where, ())))

    out_nodes = []
    for n in nodes:
        comms = tuple(
            dataclasses.replace(c, equal_grad=tuple(names[x] for x in local(("comm", n.index, i))))
            for i, c in enumerate(n.comms)
        )
        backward = tuple(
            Collective("AllReduce", tuple(names[x] for x in sorted(axes)), n.name, "avg", j)
            for (k, j), axes in sorted(found.f.items())
            if k == n.index
        )
        out_nodes.append(dataclasses.replace(n, comms=comms, backward=backward))
    out_edges = tuple(
        dataclasses.replace(e, equal_grad=local(("edge", i, 0))) for i, e in enumerate(edges)
    )
    equal = {p: tuple(sorted(found.params[p])) for p in params if p in found.params}
    return tuple(out_nodes), out_edges, equal
