"""The candidate strategies of every node and parameter, for the automatic planners.

A `Choice` is one strategy of one node: the placements its inputs must have (on the plan's
global device matrix), its outputs' placements, where it came from and, for a primitive, its
in_strategy. `Choices.build` makes them in graph order (one node's: `_one_node._OneNode`,
which `Choices` inherits):

- fixed nodes get one: an annotated primitive (its ``shard()`` strategy), an op annotated with
  ``sw.shard``'s op form, a ``sw.reshard`` node;
- an unannotated primitive gets every strategy its rule accepts whose device matrix refines
  onto the global one (`ops.candidate_strategies`);
- a torch op gets what following its aten program gives (`_follow._Follow._follow`) from each
  combination of its inputs' candidate placements (`_combos`; capped at `MAX_COMBOS`: then one
  input varied at a time, and the placements annotated ops reading an input need it in paired
  with each of the parameters'), and from the data-parallel inputs; an input it changes in
  place that is a buffer or an alias of one (`_in_place.buffer_writes`) is given whole;
- a parameter that no declaration or loaded file fixes gets every placement of its dims over
  the matrix's axes (`value_placements`) and the one an annotated primitive reads it in
  (`_annotated_reads`: an interleaved split), its storage chosen with its consumers; inputs,
  buffers and constants keep the one placement they arrive in.

After the forward pass, `Choices.build` asks each torch op for the placements its consumers'
choices want of its output (`_wanted`: the op's inputs given that placement where their shape
is the output's) and runs the forward pass again, until no op is asked for a new placement:
annotations propagate backwards as well as forwards, through chains of ops. A pass after the
first visits only the nodes asked for a placement and those whose inputs gained one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate, Shard

from shardwise.layout import TensorLayout, refine
from shardwise.ops import OpPlan
from shardwise.ops._dtensor import candidates
from shardwise.planner._graph import Graph, Ref
from shardwise.planner._one_node import MAX_COMBOS as MAX_COMBOS
from shardwise.planner._one_node import Choice as Choice
from shardwise.planner._one_node import _OneNode
from shardwise.planner._placement import (
    Placements,
    PlanError,
    placements_of,
    to_placed,
)
from shardwise.planner._plan import Placed

if TYPE_CHECKING:
    from shardwise.planner._planner import Planner

BACKWARD_PASSES = 16
"""Most backward passes of `Choices.build` (a wanted placement travels one op per pass)."""


def placed_key(c: Choice) -> tuple[int, tuple[Placements, ...], tuple[Placements, ...]]:
    """What tells a node's candidates apart: a primitive's plan and the placements. Two of a
    torch op that differ only in the rule they came from (DTensor's, or the run-it-whole
    fallback, on the same placements) run alike and cost the same: one candidate (explain
    listed both)."""
    return id(c.plan), c.need, c.outs


def value_placements(planner: Planner, shape: tuple[int, ...]) -> list[Placements]:
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


class Choices(_OneNode):
    """Builds the candidate `Choice`s of a graph's nodes and parameters (module docstring).

    Args:
        planner: the `_planner.Planner` of the graph (its matrix, inputs' state, and the
            op-form annotations already pinned).
        graph: the captured graph.
        fixed: annotated primitive nodes -> their `OpPlan`.
        given: parameters whose storage layout is fixed (declared or loaded).
    """

    def __init__(
        self,
        planner: Planner,
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
        self._fixed_reads: dict[Ref, list[tuple[int, int]]] | None = None  # (`_sibling_needs`)
        self._canonical: dict[tuple[Choice, int], Choice] = {}
        self._placements: dict[Placements, Placements] = {}
        self._found_ids: dict[int, set[object]] = {}  # node -> its choices' `placed_key`s
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
        for name, read in self._annotated_reads().items():
            if read not in self.params[name]:
                self.params[name] = [*self.params[name], read]
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

    def _annotated_reads(self) -> dict[str, Placements]:
        """Each free parameter an annotated primitive reads -> the placements it reads it in
        (canonical): a storage candidate too, since `value_placements` splits a dim over
        several axes in mesh order only (an interleaved ``("mp", "dp")`` split is not among
        them). Two annotated ops reading one parameter alike is `_propagate._check_shared`'s."""
        out: dict[str, Placements] = {}
        for index, op in self.fixed.items():
            for ref, layout in zip(self.graph.nodes[index].inputs, op.inputs, strict=True):
                if ref.kind == "param" and str(ref.key) not in self.given:
                    read = placements_of(Placed(refine(layout, self.p.matrix)))
                    out.setdefault(str(ref.key), self._placements.setdefault(read, read))
        return out

    # -- the forward pass ------------------------------------------------------------------
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
                if placed_key(c) not in ids:  # (one of those placing it alike: the first)
                    ids.add(placed_key(c))
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
