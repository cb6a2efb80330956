"""The candidates of one node, for `_choices.Choices` (which inherits `_OneNode`).

- `Choice`: one strategy of one node.
- `_OneNode._node`: a node's candidates: a fixed node's one (an annotated primitive, an
  op-form annotation, a ``sw.reshard``), an unannotated primitive's (`_primitive`: every
  strategy its rule accepts on the matrix), a torch op's (`_follow` from each input placement
  combination of `_combos` and `_from_wanted`, a buffer it changes in place given whole; a
  training batch norm given split rows keeps them split, `_batch_norm.split_batch_norm`);
  memoized by what they depend on (`_sig_id`: the op and its global metadata; `_known_id`:
  the list of placements each input may have), so repeated layers cost a lookup.
- `_OneNode._canon`: one object per distinct candidate and per distinct placement, so that
  `Choices` compares them by identity; a torch op's candidates placing everything alike are
  one (`_choices.placed_key`: the rule they came from is only shown).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.layout import refine
from shardwise.ops import OpPlan, Strategy
from shardwise.ops._candidates import candidate_strategies
from shardwise.planner._annotated import RESHARD, reshard_layout
from shardwise.planner._batch_norm import split_batch_norm
from shardwise.planner._graph import AtenArg, Graph, Node, Ref
from shardwise.planner._in_place import buffer_write_error, buffer_writes, whole_inputs
from shardwise.planner._placement import (
    Placements,
    PlanError,
    _global_axes,
    placements_of,
    to_placed,
)
from shardwise.planner._plan import Placed

if TYPE_CHECKING:
    from shardwise.planner._planner import Planner

MAX_COMBOS = 64
"""Most input-placement combinations a torch op is followed from (beyond: `_OneNode._combos`)."""


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
        own: matrix axes over which the op's own strategy leaves an output partial because an
            input is split there (a contraction over a split dim: a row-parallel linear, a sum
            over a split dim): reducing them is the op's own collective, as a primitive's
            AllReduce (not an add passing partial sums on).
    """

    need: tuple[Placements, ...]
    outs: tuple[Placements, ...]
    rule: str
    strategy: Strategy | None = None
    plan: OpPlan | None = field(default=None, compare=False, hash=False)
    compute: int = 0
    reduced: frozenset[int] = frozenset()
    split: int = 1
    own: frozenset[int] = frozenset()


class _OneNode:
    """The per-node half of `_choices.Choices` (which sets the attributes below)."""

    p: Planner
    graph: Graph
    fixed: Mapping[int, OpPlan]
    params: dict[str, list[Placements]]
    values: dict[Ref, list[Placements]]
    _followed: dict[tuple[int, tuple[Placements, ...]], Choice | str]
    _torch: dict[object, tuple[list[Choice], str | None]]
    _sig_ids: dict[object, int]
    _sig_of: dict[int, int]
    _known_ids: dict[Ref, int]
    _lists: dict[tuple[int, ...], int]
    _alive: list[tuple[Placements, ...]]
    _prims: dict[object, list[Choice]]
    _signatures: dict[int, object]
    _errors: dict[int, str]
    _canonical: dict[tuple[Choice, int], Choice]
    _placements: dict[Placements, Placements]
    nodes: dict[int, list[Choice]]
    _fixed_reads: dict[Ref, list[tuple[int, int]]] | None

    def _known(self, ref: Ref) -> list[Placements]:
        if ref.kind == "param":
            return self.params[str(ref.key)]
        if ref.kind == "node":
            return self.values.get(ref, [])
        return [placements_of(self.p.state[ref])]

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
        whole = buffer_writes(self.graph, node)  # (a buffer it changes: kept whole)
        # (what a torch op's choices depend on; repeated layers ask the same)
        key = (
            self._sig_id(node),
            tuple(r.kind for r in node.inputs),
            tuple(self._known_id(r) for r in node.inputs),
            tuple(wanted),
            whole,
        )
        hit = self._torch.get(key)
        if hit is None:
            out: list[Choice] = []
            why: str | None = None
            combos = self._combos(node) + self._from_wanted(node, wanted)
            for have in whole_inputs(combos, whole, self.p.rep()):
                got = self._follow(node, have)
                if isinstance(got, str):
                    why = why or got
                elif any(got.need[i] != self.p.rep() for i in whole):
                    why = why or buffer_write_error(node, whole, self.p.matrix)
                elif all((got.need, got.outs) != (x.need, x.outs) for x in out):
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
        strided shards in an order the matrix cannot give), splits a dim unevenly (DTensor
        allows it; shardwise's blocks are equal), or is a partial value other than a plain sum
        or mean (an internal check: `ops.aten_rules.decide` asks DTensor again, the inputs whole
        on such axes, rather than answer with a max, norm or masked partial)."""
        m = self.p.matrix
        infos = [self.graph.info(r) for r in node.inputs] + list(node.outputs)
        for placed in [*need, *outs]:
            if any(isinstance(p, Partial) and type(p) is not Partial for p in placed):
                raise ValueError(f"{placed}: a partial value other than a sum or a mean")
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
        own = frozenset(
            a
            for a in range(len(m.shape))
            if any(isinstance(pl[a], Partial) for pl in outs)
            and any(isinstance(pl[a], Shard) for pl in need)
        )
        return Choice(
            tuple(need), tuple(outs), rule, compute=-(-total // split), split=split, own=own
        )

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
        to every input of its shape at once (the others at their first), each parameter's
        varied alone, and the placements annotated ops reading an input need it in with each
        parameter's (`_with_siblings`); and the data-parallel inputs. (A bias or norm weight,
        at most 1-D, is given replicated: it takes what its first use needs.)"""
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
            out += self._with_siblings(node, known, first)
        out.append(tuple(self.p._data_parallel_inputs(node)))
        return list(dict.fromkeys(out))

    def _with_siblings(
        self, node: Node, known: list[list[Placements]], first: list[Placements]
    ) -> list[tuple[Placements, ...]]:
        """Beyond `MAX_COMBOS`: each placement an annotated op reading one of the node's
        inputs needs it in, with each placement of each parameter the node reads (HF's
        ``up_proj`` beside an annotated ``gate_proj``: the activation gathered for it with a
        column-parallel weight), the others at their first."""
        out: list[tuple[Placements, ...]] = []
        params = [j for j, r in enumerate(node.inputs) if r.kind == "param"]
        for i, need in self._sibling_needs(node):
            for j in params:
                for option in known[j]:
                    have = list(first)
                    have[i], have[j] = need, option
                    out.append(tuple(have))
        return out

    def _sibling_needs(self, node: Node) -> list[tuple[int, Placements]]:
        """(input slot, placements) an annotated op reading the same value needs it in."""
        if self._fixed_reads is None:
            self._fixed_reads = {}
            for index in [*self.fixed, *self.p.pinned]:  # (primitives; op-form annotations)
                for slot, ref in enumerate(self.graph.nodes[index].inputs):
                    self._fixed_reads.setdefault(ref, []).append((index, slot))
        out = []
        for i, ref in enumerate(node.inputs):
            if ref.kind == "param":
                continue
            for index, slot in self._fixed_reads.get(ref, ()):
                if index != node.index:
                    out += [(i, c.need[slot]) for c in self.nodes.get(index, ())]
        return out

    def _follow(self, node: Node, have: tuple[Placements, ...]) -> Choice | str:
        """The choice following the node from inputs placed `have`, or why there is none."""
        key = (self._sig_id(node), have)
        found = self._followed.get(key)
        if found is None:
            try:
                if split_batch_norm(node, have):  # (rows stay split, statistics shared)
                    rest = [self.p.rep()] * (len(have) - 1)
                    need, outs, rule = [have[0], *rest], [have[0]], "shardwise"
                else:
                    need, outs, rule = self.p._follow(node, list(have))
                self._check(node, need, outs)
            except (PlanError, ValueError) as e:  # (no rule; placements no layout expresses)
                found = str(e)
            else:
                found = self._canon(self._choice(node, need, outs, rule))
            self._followed[key] = found
        return found

    # -- backwards: what the consumers want ----------------------------------------------
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
    elif isinstance(tree, tuple | list | dict):
        for x in tree.values() if isinstance(tree, dict) else tree:
            yield from _aten_args(x)


def _strategy(op: OpPlan) -> Strategy:
    """An OpPlan's in_strategy as split counts per input dim."""
    return tuple(tuple(layout.split_count(d) for d in range(layout.ndim)) for layout in op.inputs)


def _product(known: list[list[Placements]], slots: range) -> list[tuple[Placements, ...]] | None:
    """Every combination of the known placements, or None beyond `MAX_COMBOS`."""
    if math.prod(len(known[i]) for i in slots) > MAX_COMBOS:
        return None
    return [tuple(c) for c in itertools.product(*(known[i] for i in slots))]
