"""The candidate strategies of every node and parameter, for the automatic planners.

A `Choice` is one strategy of one node: the placements its inputs must have (on the plan's
global device matrix), its outputs' placements, where it came from and, for a primitive, its
in_strategy. `Choices.build` makes them in graph order:

- fixed nodes get one: an annotated primitive (its ``shard()`` strategy), an op annotated with
  ``sw.shard``'s op form, a ``sw.reshard`` node;
- an unannotated primitive gets every strategy its rule accepts whose device matrix refines
  onto the global one (`ops.candidate_strategies`);
- a torch op gets what following its aten program gives (`_follow._Follow._follow`) from each
  combination of its inputs' candidate placements (`_combos`; capped at `MAX_COMBOS`: then one
  input varied at a time), and from the data-parallel inputs;
- a parameter that no declaration or loaded file fixes gets every placement of its dims over
  the matrix's axes (`value_placements`), its storage chosen with its consumers; inputs,
  buffers and constants keep the one placement they arrive in.

After the forward pass, `Choices.build` asks each torch op for the placements its consumers'
choices want of its output (`_wanted`: the op's inputs given that placement where their shape
is the output's) and runs the forward pass again, until no op is asked for a new placement:
annotations propagate backwards as well as forwards, through chains of ops.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate, Shard

from shardwise.layout import TensorLayout, refine
from shardwise.ops import OpPlan, Strategy
from shardwise.ops._candidates import candidate_strategies
from shardwise.ops._dtensor import candidates
from shardwise.planner._annotated import RESHARD, reshard_layout
from shardwise.planner._graph import AtenArg, Graph, Node, Ref
from shardwise.planner._placement import (
    Placements,
    PlanError,
    _global_axes,
    placements_of,
    to_placed,
)
from shardwise.planner._plan import Placed

if TYPE_CHECKING:
    from shardwise.planner._semi_auto import _Planner

BACKWARD_PASSES = 16
"""Most backward passes of `Choices.build` (a wanted placement travels one op per pass)."""
MAX_COMBOS = 64
"""Most input-placement combinations a torch op is followed from (beyond: `Choices._combos`)."""


@dataclass(frozen=True)
class Choice:
    """One candidate strategy of a node.

    Attributes:
        need: per tensor input, the placements it must have.
        outs: per output, its placements.
        rule: where it came from (``"user"``, ``"propagated"``, the rule source of a torch op:
            ``"dtensor"``, ``"shardwise"``, ``"replicate"`` ...).
        strategy: a primitive's in_strategy (None for torch ops).
        plan: a primitive's `OpPlan` for that strategy.
        compute: its outputs' elements over the devices that share the work (the product of
            the axes that split or leave partial any input or output): a proxy of one rank's
            compute.
        reduced: matrix axes over which the op's own collectives combined its outputs (a
            primitive's AllReduce after a split contraction).
        split: the devices that share the op's work (see `compute`).
    """

    need: tuple[Placements, ...]
    outs: tuple[Placements, ...]
    rule: str
    strategy: Strategy | None = None
    plan: OpPlan | None = field(default=None, compare=False, hash=False)
    compute: int = 0
    reduced: frozenset[int] = frozenset()
    split: int = 1


def value_placements(planner: _Planner, shape: tuple[int, ...]) -> list[Placements]:
    """Every placement of a tensor of `shape` with each matrix axis replicating it or splitting
    one dim that divides (replicated first)."""
    m = planner.matrix
    per_axis = []
    for size in m.shape:
        opts: list[Replicate | Shard] = [Replicate()]
        if size > 1:
            opts += [Shard(d) for d in range(len(shape))]
        per_axis.append(opts)
    out: list[Placements] = []
    for combo in itertools.product(*per_axis):
        placed: Placements = tuple(combo)
        try:
            layout = to_placed(m, placed, len(shape)).layout
        except ValueError:
            continue
        if all(shape[d] % layout.split_count(d) == 0 for d in range(len(shape))):
            out.append(placed)
    return out


class Choices:
    """Builds the candidate `Choice`s of a graph's nodes and parameters (module docstring).

    Args:
        planner: the `_semi_auto._Planner` of the graph (its matrix, inputs' state, and the
            op-form annotations already pinned).
        graph: the captured graph.
        fixed: annotated primitive nodes -> their `OpPlan`.
        given: parameters whose storage layout is fixed (declared or loaded).
    """

    def __init__(
        self,
        planner: _Planner,
        graph: Graph,
        fixed: Mapping[int, OpPlan],
        given: Mapping[str, TensorLayout],
    ) -> None:
        self.p = planner
        self.graph = graph
        self.fixed = fixed
        self.given = given
        self.nodes: dict[int, list[Choice]] = {}
        self.params: dict[str, list[Placements]] = {}
        self.values: dict[Ref, list[Placements]] = {}
        # by node signature (repeated layers share them)
        self._followed: dict[tuple[int, tuple[Placements, ...]], Choice | str] = {}
        self._torch: dict[object, tuple[list[Choice], str | None]] = {}
        self._sig_ids: dict[object, int] = {}
        self._sig_of: dict[int, int] = {}  # node -> its signature's number
        self._known_ids: dict[Ref, int] = {}
        self._lists: dict[tuple[int, ...], int] = {}  # ids of known placements -> number
        self._alive: list[tuple[Placements, ...]] = []
        self._prims: dict[object, list[Choice]] = {}
        self._signatures: dict[int, object] = {}
        self._errors: dict[int, str] = {}  # node -> the first reason a candidate failed
        self._readers: dict[int, list[int]] | None = None
        self._canonical: dict[tuple[Choice, int], Choice] = {}
        self._placements: dict[Placements, Placements] = {}
        self._found_ids: dict[int, set[int]] = {}  # node -> ids of its choices
        self._seen_ids: dict[Ref, set[int]] = {}  # value -> ids of its known placements
        self._grown: set[int] = set()  # nodes whose choices grew since the last `_wanted`

    def build(self) -> Choices:
        """Make every node's and parameter's candidates: forward, then backward passes (the
        placements consumers want, each followed by a forward pass) until no op is asked for a
        new placement, at most `BACKWARD_PASSES` times. DTensor is asked for candidates
        (`ops._dtensor.candidates`): on a matrix of several axes, any strategy of its rules,
        not only the one its own search prefers."""
        with candidates():
            return self._build()

    def _build(self) -> Choices:
        by_shape: dict[tuple[int, ...], list[Placements]] = {}
        for name, info in self.graph.params.items():
            if name in self.given:
                given = placements_of(Placed(refine(self.given[name], self.p.matrix)))
                self.params[name] = [self._placements.setdefault(given, given)]  # (canonical)
            else:
                if info.shape not in by_shape:
                    by_shape[info.shape] = value_placements(self.p, info.shape)
                self.params[name] = by_shape[info.shape]
        self._forward()
        tried: set[tuple[int, Placements]] = set()
        for _ in range(BACKWARD_PASSES):  # (a want travels one op back per pass)
            wanted = {k: [w for w in ws if (k, w) not in tried] for k, ws in self._wanted().items()}
            wanted = {k: ws for k, ws in wanted.items() if ws}
            if not wanted:
                break
            tried |= {(k, w) for k, ws in wanted.items() for w in ws}
            self._forward(wanted)
        return self

    # -- the forward pass ------------------------------------------------------------------
    def _known(self, ref: Ref) -> list[Placements]:
        if ref.kind == "param":
            return self.params[str(ref.key)]
        if ref.kind == "node":
            return self.values.get(ref, [])
        return [placements_of(self.p.state[ref])]

    def _forward(self, wanted: Mapping[int, list[Placements]] | None = None) -> None:
        """One pass in graph order. The first visits every node; a later one (`wanted` given)
        only the nodes asked for a placement and those whose inputs gained one since their
        last visit: any other node's choices would come out the same."""
        first = wanted is None
        wanted = wanted or {}
        queue = list(range(len(self.graph.nodes))) if first else sorted(wanted)
        queued = set(queue)
        readers = self._consumers()
        while queue:  # (a min-heap of node indices: graph order)
            node = self.graph.nodes[heapq.heappop(queue)]
            found = self.nodes.setdefault(node.index, [])
            before = len(found)
            ids = self._found_ids.setdefault(node.index, set())
            for c in self._node(node, wanted.get(node.index, [])):  # (canonical: `_canon`)
                if id(c) not in ids:
                    ids.add(id(c))
                    found.append(c)
            if len(found) > before:
                self._grown.add(node.index)
            if not found:
                why = self._errors.get(node.index)
                raise PlanError(
                    why
                    or f"{node.name} ({node.op} at {node.source}): no strategy fits the device "
                    f"matrix {self.p.matrix}; annotate it with shard()"
                )
            grew = False
            for o in range(len(node.outputs)):
                ref = Ref("node", node.index, o)
                seen = self.values.setdefault(ref, [])
                seen_ids = self._seen_ids.setdefault(ref, set())
                n = len(seen)
                for c in found[before:]:
                    if id(c.outs[o]) not in seen_ids:
                        seen_ids.add(id(c.outs[o]))
                        seen.append(c.outs[o])
                if len(seen) > n or ref not in self._known_ids:
                    self._known_ids[ref] = self._intern(seen)
                    grew = True
            if grew and not first:
                for i in readers.get(node.index, ()):
                    if i not in queued:
                        queued.add(i)
                        heapq.heappush(queue, i)

    def _consumers(self) -> dict[int, list[int]]:
        """Node -> the nodes that read one of its outputs."""
        if self._readers is None:
            self._readers = {}
            for node in self.graph.nodes:
                for ref in dict.fromkeys(r for r in node.inputs if r.kind == "node"):
                    self._readers.setdefault(int(ref.key), []).append(node.index)
        return self._readers

    def _node(self, node: Node, wanted: list[Placements]) -> list[Choice]:
        """The node's choices (fixed nodes: one)."""
        if node.index in self.fixed:
            c = self._op_choice(node, self.fixed[node.index], "user")
            if c is None:  # (the global matrix refines every fixed op's)
                raise AssertionError(node.name)
            return [self._canon(c)]
        if node.index in self.p.pinned:
            need, outs = self.p.pinned[node.index]
            return [self._canon(self._choice(node, need, outs, "user"))]
        if node.op == RESHARD:
            shape = self.graph.info(node.inputs[0]).shape
            layout = reshard_layout(node, shape, self.p.device_num)
            placed = placements_of(Placed(refine(layout, self.p.matrix)))
            return [self._canon(self._choice(node, [placed], [placed], "user"))]
        if node.is_primitive:
            return self._primitive(node)
        # (what a torch op's choices depend on; repeated layers ask the same)
        key = (
            self._sig_id(node),
            tuple(r.kind for r in node.inputs),
            tuple(self._known_id(r) for r in node.inputs),
            tuple(wanted),
        )
        hit = self._torch.get(key)
        if hit is None:
            out: list[Choice] = []
            why: str | None = None
            combos = self._combos(node)
            combos += self._from_wanted(node, wanted)
            for have in combos:
                got = self._follow(node, have)
                if isinstance(got, str):
                    why = why or got
                elif all(got is not x for x in out):  # (canonical: `_canon`)
                    out.append(got)
            hit = self._torch[key] = (out, why)
        if hit[1] is not None:
            self._errors.setdefault(node.index, hit[1])
        return hit[0]

    def _canon(self, c: Choice) -> Choice:
        """The one object of each distinct choice, its placements one object each too: the
        passes compare them by identity."""
        key = (c, id(c.plan))  # (equality leaves the primitive's plan out: not here)
        found = self._canonical.get(key)
        if found is None:
            need = tuple(self._placements.setdefault(p, p) for p in c.need)
            outs = tuple(self._placements.setdefault(p, p) for p in c.outs)
            found = self._canonical[key] = dataclasses.replace(c, need=need, outs=outs)
        return found

    def signature_id(self, node: Node) -> int:
        """A number per distinct `_signature`: nodes with equal numbers are the same op on the
        same global metadata (repeated layers), whose candidates mean the same."""
        return self._sig_id(node)

    def _sig_id(self, node: Node) -> int:
        """A number per distinct `_signature`."""
        found = self._sig_of.get(node.index)
        if found is None:
            sig = self._signature(node)
            found = self._sig_of[node.index] = self._sig_ids.setdefault(sig, len(self._sig_ids))
        return found

    def _known_id(self, ref: Ref) -> int:
        """A number per distinct list of a value's known placements (`_known`)."""
        found = self._known_ids.get(ref)
        if found is None:
            found = self._known_ids[ref] = self._intern(self._known(ref))
        return found

    def _intern(self, placements: list[Placements]) -> int:
        """A number per list of the same placement objects (kept alive, so ids stay theirs)."""
        key = tuple(map(id, placements))
        found = self._lists.get(key)
        if found is None:
            found = self._lists[key] = len(self._lists)
            self._alive.append(tuple(placements))
        return found

    def _check(self, node: Node, need: list[Placements], outs: list[Placements]) -> None:
        """Raise ValueError when a placement has no `TensorLayout` on the matrix (DTensor's
        strided shards in an order the matrix cannot give) or splits a dim unevenly (DTensor
        allows it; shardwise's blocks are equal)."""
        m = self.p.matrix
        infos = [self.graph.info(r) for r in node.inputs] + list(node.outputs)
        for placed, info in zip([*need, *outs], infos, strict=True):
            layout = to_placed(m, placed, len(info.shape)).layout
            for d, size in enumerate(info.shape):
                if size % layout.split_count(d):
                    raise ValueError(f"dim {d} of size {size} splits unevenly")

    def _choice(
        self, node: Node, need: list[Placements], outs: list[Placements], rule: str
    ) -> Choice:
        m = self.p.matrix
        split = 1
        for axis, size in enumerate(m.shape):
            if any(not isinstance(pl[axis], Replicate) for pl in [*need, *outs]):
                split *= size
        total = sum(math.prod(info.shape) for info in node.outputs)
        return Choice(tuple(need), tuple(outs), rule, compute=-(-total // split), split=split)

    def _op_choice(self, node: Node, op: OpPlan, rule: str) -> Choice | None:
        m = self.p.matrix
        try:
            need = [placements_of(Placed(refine(t, m))) for t in op.inputs]
            outs = [placements_of(Placed(refine(t, m))) for t in op.outputs]
        except ValueError:  # (its matrix does not refine onto the global one)
            return None
        c = self._choice(node, need, outs, rule)
        names = [g for comm in op.comms for g in _global_axes(op.matrix, comm.axes, m)]
        reduced = frozenset(m.names.index(g) for g in names)
        return Choice(c.need, c.outs, rule, _strategy(op), op, c.compute, reduced, c.split)

    def _signature(self, node: Node) -> object:
        """What a node's choices depend on: its op, its inputs' and outputs' global metadata
        and its call's other arguments, which inputs are the same value, the inputs' strides
        (equal for the same op in repeated layers)."""
        if node.index not in self._signatures:
            infos = tuple(self.graph.info(r) for r in node.inputs)
            aliases = tuple(node.inputs.index(r) for r in node.inputs)  # (a value read twice)
            strides = tuple(
                (x.index, x.stride)
                for call in node.aten
                for x in _aten_args((call.args, tuple(call.kwargs.values())))
                if x.kind == "in"
            )
            args = repr((node.args, sorted(node.kwargs.items())))
            if node.is_primitive:
                args += repr(node.target.op_args(**dict(node.kwargs)))
            self._signatures[node.index] = (
                node.op,
                infos,
                node.outputs,
                args,
                aliases,
                strides,
            )
        return self._signatures[node.index]

    def _primitive(self, node: Node) -> list[Choice]:
        key = self._signature(node)
        if key not in self._prims:
            shapes = [self.graph.info(r).shape for r in node.inputs]
            found = candidate_strategies(
                node.target, *shapes, device_num=self.p.device_num, **dict(node.kwargs)
            )
            choices = [self._op_choice(node, op, "propagated") for _, op in found]
            self._prims[key] = [self._canon(c) for c in choices if c is not None]
        return self._prims[key]

    def _combos(self, node: Node) -> list[tuple[Placements, ...]]:
        """Input placements to follow the node from: every combination of its inputs' known
        placements while there are at most `MAX_COMBOS`; beyond, each known placement given
        to every input of its shape at once (the others at their first), and each parameter's
        varied alone; and the data-parallel inputs. (A bias or norm weight, at most 1-D, is
        given replicated: it takes what its first use needs.)"""
        known = [self._known(r) or [self.p.rep()] for r in node.inputs]
        for i, r in enumerate(node.inputs):
            if r.kind == "param" and len(self.graph.info(r).shape) <= 1:
                known[i] = [self.p.rep()]
        out = _product(known, range(len(known)))
        if out is None:
            first = [k[0] for k in known]
            shapes = [self.graph.info(r).shape for r in node.inputs]
            out = [tuple(first)]
            for i, options in enumerate(known):
                for option in options:
                    have = list(first)
                    for j, shape in enumerate(shapes):
                        if j == i or (shape == shapes[i] and node.inputs[j].kind != "param"):
                            have[j] = option
                    out.append(tuple(have))
        out.append(tuple(self.p._data_parallel_inputs(node)))
        return list(dict.fromkeys(out))

    def _follow(self, node: Node, have: tuple[Placements, ...]) -> Choice | str:
        """The choice following the node from inputs placed `have`, or why there is none."""
        key = (self._sig_id(node), have)
        found = self._followed.get(key)
        if found is None:
            try:
                need, outs, rule = self.p._follow(node, list(have))
                self._check(node, need, outs)
            except (PlanError, ValueError) as e:  # (no rule; placements no layout expresses)
                found = str(e)
            else:
                found = self._canon(self._choice(node, need, outs, rule))
            self._followed[key] = found
        return found

    # -- backwards: what the consumers want ----------------------------------------------
    def _wanted(self) -> dict[int, list[Placements]]:
        """Torch op -> the placements of its output 0 that some consumer's choice needs and
        none of its own choices gives."""
        out: dict[int, list[Placements]] = {}
        grown, self._grown = sorted(self._grown), set()  # (the others ask again what was tried)
        for node in (self.graph.nodes[i] for i in grown):
            for slot, ref in enumerate(node.inputs):
                if ref.kind != "node" or ref.index != 0:
                    continue
                producer = self.graph.nodes[int(ref.key)]
                if producer.is_primitive or producer.index in self.fixed:
                    continue
                have = {id(c.outs[0]) for c in self.nodes[producer.index]}
                for c in self.nodes[node.index]:
                    want = c.need[slot]  # (canonical objects: compared by identity)
                    asked = out.setdefault(producer.index, [])
                    if id(want) not in have and all(want is not w for w in asked):
                        asked.append(want)
        return out

    def _from_wanted(self, node: Node, wanted: list[Placements]) -> list[tuple[Placements, ...]]:
        """For each wanted output placement: the node's inputs of the output's shape given it,
        the others at their first known placement."""
        if not wanted or not node.outputs:
            return []
        shape = node.outputs[0].shape
        out = []
        for want in wanted:
            have = []
            for r in node.inputs:
                known = self._known(r) or [self.p.rep()]
                same = self.graph.info(r).shape == shape and r.kind in ("node", "param")
                have.append(want if same else known[0])
            out.append(tuple(have))
        return out


def _aten_args(tree: object) -> Iterator[AtenArg]:
    """The `AtenArg`s in nested tuples / lists / dicts, in order."""
    if isinstance(tree, AtenArg):
        yield tree
    elif isinstance(tree, tuple | list):
        for x in tree:
            yield from _aten_args(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _aten_args(x)


def _strategy(op: OpPlan) -> Strategy:
    """An OpPlan's in_strategy as split counts per input dim."""
    return tuple(tuple(layout.split_count(d) for d in range(layout.ndim)) for layout in op.inputs)


def _product(known: list[list[Placements]], slots: range) -> list[tuple[Placements, ...]] | None:
    """Every combination of the known placements, or None beyond `MAX_COMBOS`."""
    if math.prod(len(known[i]) for i in slots) > MAX_COMBOS:
        return None
    return [tuple(c) for c in itertools.product(*(known[i] for i in slots))]
