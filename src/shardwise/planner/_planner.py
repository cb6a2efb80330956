"""The state of one planning walk over a captured graph: `Planner`.

`semi_auto`'s walk (`_semi_auto.walk`) and the automatic modes' (through `_semi_auto.setup`)
keep every value's placement in `Planner.state` and collect the plan's nodes and edges:

- `Planner.edge`: a consumer wants a value elsewhere than it is: an `EdgePlan` (the cheapest
  redistribution steps; ``shared`` when this forward already moved the value the same way);
- `Planner.primitive`: a shardwise primitive takes its rule's layouts and collectives (a
  training ``BatchNorm`` primitive on split rows also gathers its statistics);
- `Planner.torch_node`: a torch op takes an op-form annotation's layouts, an automatic
  planner's decision, a ``sw.reshard``'s layout, a split batch norm's, or follows its inputs
  (`_Follow._cheaper`); a view an in-place op changes, and that op, run on their input as it
  is placed where a rule runs them so (`_in_place.written_through`); item assignment that
  would cut a block of a fill has the fill made as that block instead where every earlier
  read cut it so (`_local_factories.split_fill`); random fills, in-place write-backs and the
  op's local kind (weighted mean loss, attention dropout, global draws) are recorded with it.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Replicate

from shardwise.layout import DeviceMatrix, refine
from shardwise.ops import OpPlan
from shardwise.ops._dtensor import mesh_of
from shardwise.planner._annotated import RESHARD, reshard_layout
from shardwise.planner._batch_norm import SPLIT_BATCH_NORM, split_batch_norm, stats_gather
from shardwise.planner._draws import (
    ATTENTION_DROPOUT,
    DROPOUT,
    GLOBAL_DRAWS,
    SDPA,
    attention_dropout,
    plan_draws,
)
from shardwise.planner._follow import _Follow
from shardwise.planner._graph import Graph, Node, Ref
from shardwise.planner._in_place import (
    check_change,
    shared_input,
    write_back_edges,
    written_through,
)
from shardwise.planner._local_factories import split_fill
from shardwise.planner._losses import WEIGHTED_MEAN, weighted_mean
from shardwise.planner._placement import (
    Placements,
    PlanError,
    _global_axes,
    _itemsize,
    placements_of,
    to_placed,
)
from shardwise.planner._plan import Collective, EdgePlan, NodePlan, Placed
from shardwise.planner._strided_reads import check_strided_read
from shardwise.redistribution import plan_redistribution


class Planner(_Follow):
    """The state of one planning walk (following aten programs: `_Follow`)."""

    def __init__(self, graph: Graph, device_num: int, matrix: DeviceMatrix) -> None:
        self.graph = graph
        self.device_num = device_num
        self.matrix = matrix
        self.ndim = len(matrix.shape)
        self.mesh = mesh_of(matrix.shape, matrix.names, matrix.rank_list)
        self.state: dict[Ref, Placed] = {}
        self.edges: list[EdgePlan] = []
        self.nodes: list[NodePlan] = []
        # op-form annotated nodes: index -> (input placements, output placements)
        self.pinned: dict[int, tuple[list[Placements], list[Placements]]] = {}
        self.moved: set[tuple[Ref, Placed, Placed]] = set()  # moves made so far (`EdgePlan.shared`)
        # an automatic planner's decisions: index -> (input placements, outputs', rule)
        self.chosen: dict[int, tuple[list[Placements], list[Placements], str]] = {}
        self.through: frozenset[int] | None = None  # (`written_through`, on first use)

    def edge(self, consumer: int, slot: int, ref: Ref, dst: Placed) -> None:
        """Move value `ref` to `dst` for `consumer` (an `EdgePlan` when it is elsewhere)."""
        src = self.state[ref]
        if src == dst:
            return
        info = self.graph.info(ref)
        steps = plan_redistribution(src.layout, dst.layout, info.shape, _itemsize(info.dtype))
        shared = consumer >= 0 and (ref, src, dst) in self.moved
        self.moved.add((ref, src, dst))
        edge = EdgePlan(
            consumer, slot, str(ref), info.shape, src, dst, steps.steps, shared, info.dtype
        )
        self.edges.append(edge)

    # -- primitives ----------------------------------------------------------------------
    def primitive(self, node: Node, op: OpPlan, rule: str | None = None) -> None:
        m = self.matrix
        ins = tuple(Placed(refine(t, m)) for t in op.inputs)
        outs = tuple(Placed(refine(t, m)) for t in op.outputs)
        for i, (ref, dst) in enumerate(zip(node.inputs, ins, strict=True)):
            self.edge(node.index, i, ref, dst)
        for j, p in enumerate(outs):
            self.state[Ref("node", node.index, j)] = p
        comms = tuple(
            Collective(c.kind, _global_axes(op.matrix, c.axes, m), node.name, c.op, c.output, c.dim)
            for c in op.comms
        )
        if op.local == "batch_stats" and node.target.init_args()["is_training"]:
            info = self.graph.info(node.inputs[0])
            comms += stats_gather(node.name, ins[0].layout, info.shape, info.dtype)
        if rule is None:
            rule = "user" if op.user_set else "default"
        shapes = tuple(tuple(s) for s in op.output_shapes)
        self._add(node, rule, ins, outs, shapes, comms, op.local)

    def _add(
        self,
        node: Node,
        rule: str,
        ins: tuple[Placed, ...],
        outs: tuple[Placed, ...],
        shapes: tuple[tuple[int, ...], ...],
        comms: tuple[Collective, ...],
        local: str,
        draws: tuple[tuple[Placed, tuple[int, ...], tuple[int, ...]], ...] = (),
    ) -> None:
        """Append `node`'s `NodePlan` (its inputs' values and global shapes from the graph)."""
        values = tuple(str(r) for r in node.inputs)
        in_shapes = tuple(self.graph.info(r).shape for r in node.inputs)
        dtypes = tuple(o.dtype for o in node.outputs)
        returned = tuple(a.index for a in node.out_map if a is not None and a.kind == "in")
        self.nodes.append(
            NodePlan(
                node.index,
                node.name,
                node.op,
                rule,
                ins,
                outs,
                shapes,
                comms,
                values,
                local,
                in_shapes,
                dtypes=dtypes,
                draws=draws,
                returned=returned,
            )
        )

    # -- torch ops -----------------------------------------------------------------------
    def _torch_choice(
        self, node: Node, have: list[Placements]
    ) -> tuple[list[Placements], list[Placements], str]:
        """A torch op's input and output placements and their rule (`torch_node`)."""
        if node.index in self.pinned:
            need, outs = self.pinned[node.index]
            return need, outs, "user"
        if node.index in self.chosen:
            need, outs, rule = self.chosen[node.index]
        elif node.op == RESHARD:
            layout = reshard_layout(node, self.graph.info(node.inputs[0]).shape, self.device_num)
            need = outs = [placements_of(Placed(refine(layout, self.matrix)))]
            return need, outs, "user"
        elif split_batch_norm(node, have):  # (rows stay split, statistics shared)
            whole = tuple(Replicate() for _ in range(self.ndim))
            return [have[0], *[whole] * (len(have) - 1)], [have[0]], "shardwise"
        else:
            need, outs, rule = self._cheaper(node, have)
        if self.through is None:
            self.through = written_through(self.graph)
        slot = shared_input(node) or 0
        if node.index in self.through and need[slot] != have[slot]:
            try:  # (a view changed in place, or the change: on its input as it is placed)
                kept = self._follow(node, have)
            except PlanError:
                return need, outs, rule
            if kept[0][slot] == have[slot]:
                return kept
        return need, outs, rule

    def _check_change(self, node: Node, moved: Placed | None) -> None:
        """Raise when `node` changes its input 0 in place where the executor cannot hand the
        change on (`check_change`), unless the value is a fill that can be made as the block
        `moved` cuts of it (``out = torch.zeros(x.size(0), 8); out[:, :4] = h[:, :4]``): it is
        then placed so from here on, its earlier cuts of that block dropped (`split_fill`)."""
        error = check_change(self.graph, self.state, self.edges, node, moved)
        if error is None:
            return
        ref = node.inputs[0]
        if moved is not None:
            kept = split_fill(self.graph, ref, self.state[ref], moved, self.edges, node.index)
            if kept is not None:
                self.edges, self.state[ref] = kept, moved
                at = next(i for i, n in enumerate(self.nodes) if n.index == int(ref.key))
                self.nodes[at] = dataclasses.replace(self.nodes[at], outputs=(moved,))
                return
        raise PlanError(error)

    def torch_node(self, node: Node) -> None:
        have = [placements_of(self.state[r]) for r in node.inputs]
        need, outs, rule = self._torch_choice(node, have)
        split = split_batch_norm(node, need)  # (split rows chosen by a planner too)
        draws = plan_draws(node, need, lambda n, h, seen: self._follow(n, h, seen=seen))
        ins = tuple(
            to_placed(self.matrix, p, len(self.graph.info(r).shape))
            for p, r in zip(need, node.inputs, strict=True)
        )
        if node.inputs:
            moved = ins[0] if self.state[node.inputs[0]] != ins[0] else None
            self._check_change(node, moved)
            check_strided_read(node, self.state, ins)
        for i, (ref, dst) in enumerate(zip(node.inputs, ins, strict=True)):
            self.edge(node.index, i, ref, dst)
        self.edges += write_back_edges(self.graph, self.state, node, ins)
        placed = tuple(
            to_placed(self.matrix, p, len(info.shape))
            for p, info in zip(outs, node.outputs, strict=True)
        )
        for j, p in enumerate(placed):
            self.state[Ref("node", node.index, j)] = p
        shapes = tuple(o.shape for o in node.outputs)
        local = ""
        if split:
            local = SPLIT_BATCH_NORM
        elif placed and weighted_mean(node, placed[0], self.graph, ins):
            local = WEIGHTED_MEAN
        elif attention_dropout(node):
            local = ATTENTION_DROPOUT
        elif draws and node.op not in (DROPOUT, SDPA):
            local = GLOBAL_DRAWS
        comms: tuple[Collective, ...] = ()
        if split:
            info = self.graph.info(node.inputs[0])
            comms = stats_gather(node.name, ins[0].layout, info.shape, node.outputs[0].dtype)
        placed_draws = tuple((to_placed(self.matrix, p, len(s)), s, o) for p, s, o in draws)
        self._add(node, rule, ins, placed, shapes, comms, local, placed_draws)
