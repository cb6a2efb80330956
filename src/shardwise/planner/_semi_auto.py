"""semi_auto planning: annotated ops keep their strategies, every other op runs data parallel.

`plan_semi_auto(graph, device_num, ...)` makes a `ParallelPlan` from a captured `Graph`:

1. `_primitives`: each shardwise primitive is planned by its own rule (`ops.plan_primitive`:
   its ``shard()`` strategy, or its data-parallel default); all their device matrices (and
   those of declared layouts) are refined into one global matrix (`common_refinement`).
2. `_start`: where every value starts: inputs split on dim 0 over all devices (MindSpore's
   ``"data_parallel"`` dataset strategy; ``"full_batch"``: whole, then sliced at entry; or the
   given per-input layouts), parameters in their declared layout or the layout their first
   primitive wants (else whole), buffers and constants whole.
3. `_torch_node`: an op annotated with ``sw.shard``'s op form takes its inputs as annotated
   (`_annotated.op_form`; `_Planner.pin` follows its aten program from there, so the bias,
   output and partial sums come from the rules, and stores its parameters that way), a
   ``sw.reshard`` node pins its value's layout, and every other op follows its inputs through
   its aten ops, asking the sharding
   rules (`ops.aten_rules.decide`: DTensor's, or shardwise's own) at each; from the
   data-parallel inputs this gives data-parallel ops (views that fold the batch dim, reductions
   over it and losses included: a mean over the batch is a partial value, all-reduced where it
   is consumed whole). When following would move the inputs (or the rule would move an
   intermediate value inside the op), `_Planner._cheaper` takes the data-parallel strategy
   if it moves fewer bytes; an op that can do neither runs replicated.
4. Every mismatch between a producer's placement and a consumer's becomes an `EdgePlan`
   (AllReduce of partial values, then the cheapest Slice / AllGather / AlltoAll steps). A
   partial scalar (a loss, a sum over the batch) and a partial returned value are all-reduced
   right where they are made (consumer -1), so the loss is one value on every rank. A whole
   value that a consumer wants partial (the bias of a row-parallel ``F.linear``) is kept on
   the first rank of those axes and zero on the others (`EdgePlan.kept`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate
from torch.utils import _pytree as pytree

from shardwise.layout import DeviceMatrix, TensorLayout, common_refinement, refine
from shardwise.ops import OpPlan, plan_primitive
from shardwise.ops._dtensor import Spec, mesh_of
from shardwise.ops.aten_rules import decide
from shardwise.planner._annotated import RESHARD, AnnotationError, op_form, reshard_layout
from shardwise.planner._graph import AtenArg, Graph, Node, Ref
from shardwise.planner._plan import (
    Collective,
    EdgePlan,
    NodePlan,
    ParallelPlan,
    ParamPlan,
    Placed,
    placements_of,
    replicated,
    to_placed,
)
from shardwise.redistribution import plan_redistribution

Shape = tuple[int, ...]
Placements = tuple[Placement, ...]
DatasetStrategy = str | Mapping[str, TensorLayout]
_ORDER = {"identity": 0, "factory": 1, "dtensor": 2, "shardwise": 3, "replicate": 4}


class PlanError(ValueError):
    """The network cannot be planned as asked; the message names the op, the tensor dim and
    the fix."""


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def data_parallel(matrix: DeviceMatrix, ndim: int) -> Placed:
    """Dim 0 split over every axis of `matrix`, outer first."""
    axes = tuple(a for a, s in enumerate(matrix.shape) if s > 1)
    return Placed(TensorLayout(matrix, (axes,) + ((),) * (ndim - 1)))


class _Planner:
    """The state of one `plan_semi_auto` call."""

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

    def rep(self) -> Placements:
        return tuple(Replicate() for _ in range(self.ndim))

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
    def primitive(self, node: Node, op: OpPlan) -> None:
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
        rule = "user" if op.user_set else "default"
        shapes = tuple(tuple(s) for s in op.output_shapes)
        values = tuple(str(r) for r in node.inputs)
        in_shapes = tuple(self.graph.info(r).shape for r in node.inputs)
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
                op.local,
                in_shapes,
            )
        )

    # -- torch ops -----------------------------------------------------------------------
    def torch_node(self, node: Node) -> None:
        self._check_random(node)
        have = [placements_of(self.state[r]) for r in node.inputs]
        if node.index in self.pinned:
            need, outs = self.pinned[node.index]
            rule = "user"
        elif node.op == RESHARD:
            layout = reshard_layout(node, self.graph.info(node.inputs[0]).shape, self.device_num)
            need = outs = [placements_of(Placed(refine(layout, self.matrix)))]
            rule = "user"
        else:
            need, outs, rule = self._cheaper(node, have)
        ins = tuple(
            to_placed(self.matrix, p, len(self.graph.info(r).shape))
            for p, r in zip(need, node.inputs, strict=True)
        )
        for i, (ref, dst) in enumerate(zip(node.inputs, ins, strict=True)):
            self.edge(node.index, i, ref, dst)
        placed = tuple(
            to_placed(self.matrix, p, len(info.shape))
            for p, info in zip(outs, node.outputs, strict=True)
        )
        for j, p in enumerate(placed):
            self.state[Ref("node", node.index, j)] = p
        shapes = tuple(o.shape for o in node.outputs)
        values = tuple(str(r) for r in node.inputs)
        in_shapes = tuple(self.graph.info(r).shape for r in node.inputs)
        self.nodes.append(
            NodePlan(
                node.index,
                node.name,
                node.op,
                rule,
                ins,
                placed,
                shapes,
                (),
                values,
                "",
                in_shapes,
            )
        )

    def pin(self, node: Node, layouts: Mapping[int, TensorLayout]) -> dict[str, TensorLayout]:
        """Plan an op-form annotated node from its inputs' `layouts` (slot -> layout); returns
        the storage layout of each parameter it reads (the partial axes left out)."""
        have = [
            placements_of(Placed(refine(layouts[i], self.matrix)))
            if i in layouts
            else placements_of(replicated(self.matrix, len(self.graph.info(r).shape)))
            for i, r in enumerate(node.inputs)
        ]
        need, outs, _ = self._follow(node, have, strict=True)
        for i in layouts:
            if need[i] != have[i]:
                raise PlanError(
                    f"sw.shard on {node.module} ({node.op} at {node.source}): the sharding rule "
                    f"of {node.op} cannot take input {i} as annotated ({have[i]}; it wants "
                    f"{need[i]}); change the strategy"
                )
        self.pinned[node.index] = (need, outs)
        out: dict[str, TensorLayout] = {}
        for i, ref in enumerate(node.inputs):
            if ref.kind == "param":
                placed = to_placed(self.matrix, need[i], len(self.graph.info(ref).shape))
                out.setdefault(str(ref.key), placed.layout)
        return out

    def _follow(
        self, node: Node, have: list[Placements], strict: bool = False
    ) -> tuple[list[Placements], list[Placements], str]:
        """Run the node's aten program on placements: (its inputs' placements, its outputs',
        the rule source). Falls back to replicated when an intermediate must move (`strict`:
        an annotated op, which raises instead)."""
        need = list(have)
        used: set[int] = set()
        tmp: dict[int, Placements] = {}
        sources = {"identity" if node.inputs else "factory"}
        for call in node.aten:
            leaves = pytree.tree_leaves((call.args, dict(call.kwargs)))
            args = [x for x in leaves if isinstance(x, AtenArg)]
            specs = {
                id(x): Spec(
                    need[x.index] if x.kind == "in" else tmp.get(x.index, self.rep()),
                    x.info.shape,
                    x.stride,
                    x.info.dtype,
                )
                for x in args
            }
            a, k = pytree.tree_map_only(AtenArg, _lookup(specs), (call.args, dict(call.kwargs)))
            try:
                dec = decide(call.op, a, k, self.mesh, self.ndim)
            except (RuntimeError, ValueError, AssertionError) as e:
                raise self._error(node, call.op, e) from None
            sources.add(dec.source)
            for arg, want in zip(args, dec.inputs, strict=False):
                cur = need[arg.index] if arg.kind == "in" else tmp.get(arg.index, self.rep())
                if want == cur:
                    continue
                if arg.kind == "in" and arg.index not in used:
                    need[arg.index] = want
                elif strict:
                    raise PlanError(
                        f"sw.shard on {node.module} ({node.op} at {node.source}): with the "
                        f"annotated layouts, {call.op} inside it would have to move an "
                        f"intermediate value; change the strategy"
                    )
                else:  # an intermediate (or an input already used) would have to move
                    return self._replicated(node)
            used |= {arg.index for arg in args if arg.kind == "in"}
            for j, out in enumerate(call.outputs):
                got = dec.outputs[j] if j < len(dec.outputs) else None
                tmp[out.index] = got if got is not None else self.rep()
        for j, ref in enumerate(node.inputs):  # a tensor passed twice: its first slot decides
            need[j] = need[node.inputs.index(ref)]
        outs = []
        for om in node.out_map:
            if om is None:
                outs.append(self.rep())
            else:
                outs.append(need[om.index] if om.kind == "in" else tmp.get(om.index, self.rep()))
        while len(outs) < len(node.outputs):
            outs.append(self.rep())
        return need, outs, max(sources, key=_ORDER.__getitem__)

    def _cheaper(
        self, node: Node, have: list[Placements]
    ) -> tuple[list[Placements], list[Placements], str]:
        """An unannotated op's strategy: it follows its inputs' placements, unless that moves
        them (or cannot run) and the data-parallel strategy (semi_auto's default) moves less."""
        need, outs, rule = self._follow(node, have)
        if not node.inputs:
            return need, outs, rule
        cost = self._cost(node, need)
        if rule != "replicate" and cost == 0:
            return need, outs, rule
        alt = self._follow(node, self._data_parallel_inputs(node))
        if alt[2] != "replicate" and (rule == "replicate" or self._cost(node, alt[0]) < cost):
            return alt
        return need, outs, rule

    def _cost(self, node: Node, need: list[Placements]) -> int:
        """Bytes a rank sends to move the node's inputs to `need` (partial sums reduced)."""
        total = 0
        for ref, want in zip(node.inputs, need, strict=True):
            src = self.state[ref]
            info = self.graph.info(ref)
            dst = to_placed(self.matrix, want, len(info.shape))
            if src == dst:
                continue
            size = _itemsize(info.dtype)
            if any(a not in dst.partial for a in src.partial):
                n = 1
                for s in src.layout.local_shape(info.shape):
                    n *= s
                total += 2 * n * size
            moved = plan_redistribution(src.layout, dst.layout, info.shape, size)
            total += moved.total_bytes
        return total

    def _data_parallel_inputs(self, node: Node) -> list[Placements]:
        """The node's activations split on dim 0 over every axis (when it divides), everything
        else whole: the data-parallel strategy semi_auto gives an op whose inputs' own layouts
        it cannot follow."""
        out = []
        for ref in node.inputs:
            shape = self.graph.info(ref).shape
            active = ref.kind in ("input", "node") and shape and shape[0] % self.device_num == 0
            placed = data_parallel(self.matrix, len(shape)) if active else None
            out.append(placements_of(placed or replicated(self.matrix, len(shape))))
        return out

    def _check_random(self, node: Node) -> None:
        """Refuse random draws that happen inside a kernel (each rank would draw its own)."""
        if node.op != "torch.nn.functional.scaled_dot_product_attention" or self.device_num == 1:
            return
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        if p:
            raise PlanError(
                f"{node.name} ({node.op} at {node.source}): scaled_dot_product_attention: "
                f"dropout_p > 0 draws its mask inside the kernel, differently on each rank; "
                f"pass dropout_p=0.0 (or apply F.dropout to the attention output)"
            )

    def _replicated(self, node: Node) -> tuple[list[Placements], list[Placements], str]:
        return [self.rep() for _ in node.inputs], [self.rep() for _ in node.outputs], "replicate"

    def _error(self, node: Node, op: Any, e: BaseException) -> PlanError:
        shapes = [list(self.graph.info(r).shape) for r in node.inputs]
        placed = [str(self.state[r]) for r in node.inputs]
        return PlanError(
            f"{node.name} ({node.op} at {node.source}): {op} cannot run on inputs of global "
            f"shapes {shapes} placed {placed} over {self.device_num} devices: {e}. Fix: make "
            f"the split dims divisible by the number of devices splitting them (e.g. a global "
            f"batch divisible by {self.device_num}), or annotate the op with shard()"
        )


def _lookup(specs: dict[int, Spec]) -> Any:
    """``arg -> its Spec`` for `pytree.tree_map_only`."""

    def find(x: AtenArg) -> Spec:
        return specs[id(x)]

    return find


def _global_axes(op_matrix: DeviceMatrix, axes: Sequence[str], m: DeviceMatrix) -> tuple[str, ...]:
    """The global axes that an op-matrix axis list covers (after refinement)."""
    from shardwise.layout import axis_runs

    runs = axis_runs(op_matrix.shape, m.shape)
    return tuple(m.names[g] for a in axes for g in runs[op_matrix.axis(a)])


def _matrix(
    ops: Sequence[OpPlan], device_num: int, extra: Sequence[Shape], given: Sequence[TensorLayout]
) -> DeviceMatrix:
    shapes = [o.matrix.shape for o in ops] + list(extra) + [t.matrix.shape for t in given]
    shape = common_refinement(shapes or [(device_num,)])
    return DeviceMatrix(shape, tuple(f"g{i}" for i in range(len(shape))))


def _input_state(
    p: _Planner, graph: Graph, dataset: DatasetStrategy
) -> tuple[dict[str, Placed], list[tuple[str, Placed]]]:
    """How each input arrives, and the inputs cut at entry (full_batch)."""
    arrive: dict[str, Placed] = {}
    entry = []
    for key, info in graph.inputs.items():
        ref = Ref("input", key)
        ndim = len(info.shape)
        if isinstance(dataset, Mapping):
            layout = dataset.get(key)
            placed = (
                replicated(p.matrix, ndim) if layout is None else Placed(refine(layout, p.matrix))
            )
            arrive[key] = p.state[ref] = placed
            continue
        if ndim == 0 or info.shape[0] % p.device_num:
            if dataset == "data_parallel" and ndim:
                raise PlanError(
                    f"input {key}: dim 0 of global shape {list(info.shape)} cannot be split over "
                    f"{p.device_num} devices (dataset strategy 'data_parallel': each rank passes "
                    f"its own rows); use a global batch divisible by {p.device_num}"
                )
            arrive[key] = p.state[ref] = replicated(p.matrix, ndim)
            continue
        dp = data_parallel(p.matrix, ndim)
        if dataset == "full_batch":
            arrive[key] = replicated(p.matrix, ndim)
            entry.append((key, dp))
        else:
            arrive[key] = dp
        p.state[ref] = dp
    return arrive, entry


def plan_semi_auto(
    graph: Graph,
    device_num: int,
    *,
    dataset: DatasetStrategy = "data_parallel",
    param_layouts: Mapping[str, TensorLayout] | None = None,
    extra_matrices: Sequence[Shape] = (),
) -> ParallelPlan:
    """Plan a captured graph the semi_auto way (see the module docstring).

    Args:
        graph: from `capture`.
        device_num: the job's size.
        dataset: ``"data_parallel"`` (each rank passes its rows), ``"full_batch"`` (each rank
            passes the whole batch), or input name -> its layout.
        param_layouts: parameter name -> the layout it is stored in (``parameter_plan``).
        extra_matrices: device-matrix shapes the global matrix must refine (``sw.reshard``).

    Returns:
        The `ParallelPlan`.

    Raises:
        PlanError: an input or op that cannot be split as asked (naming it and the fix).

    Example:
        >>> plan = plan_semi_auto(capture(model, ids, ids), device_num=4)
        >>> [str(c) for c in plan.collectives()]
        ['AllReduce(avg) over g0 at return 1']
    """
    prims = {
        n.index: plan_primitive(
            n.target,
            *[graph.info(r).shape for r in n.inputs],
            device_num=device_num,
            **dict(n.kwargs),
        )
        for n in graph.nodes
        if n.is_primitive
    }
    given = dict(param_layouts or {})
    extra = list(extra_matrices)
    if isinstance(dataset, Mapping):
        extra += [t.matrix.shape for t in dataset.values()]
    try:
        forms = {n.index: op_form(n, graph, device_num) for n in graph.nodes if n.strategy}
        extra += [m.shape for m, _ in forms.values()]
        extra += [
            reshard_layout(n, graph.info(n.inputs[0]).shape, device_num).matrix.shape
            for n in graph.nodes
            if n.op == RESHARD
        ]
    except AnnotationError as e:
        raise PlanError(str(e)) from None
    matrix = _matrix(list(prims.values()), device_num, extra, list(given.values()))
    p = _Planner(graph, device_num, matrix)
    arrive, entry = _input_state(p, graph, dataset)
    pinned: dict[str, TensorLayout] = {}
    for index, (_, layouts) in forms.items():
        for name, layout in p.pin(graph.nodes[index], layouts).items():
            pinned.setdefault(name, layout)
    params = _param_layouts(graph, prims, given, matrix, pinned)
    for name, layout in params.items():
        p.state[Ref("param", name)] = Placed(layout)
    for name, info in graph.buffers.items():
        p.state[Ref("buffer", name)] = replicated(matrix, len(info.shape))
    for i, info in enumerate(graph.consts):
        p.state[Ref("const", i)] = replicated(matrix, len(info.shape))
    for k, (key, dp) in enumerate(entry):
        info = graph.inputs[key]
        src = arrive[key]
        steps = plan_redistribution(src.layout, dp.layout, info.shape, _itemsize(info.dtype))
        edge = EdgePlan(-2, k, f"input:{key}", info.shape, src, dp, steps.steps, dtype=info.dtype)
        p.edges.append(edge)
    returned = set(graph.outputs)
    reduced = 0
    for node in graph.nodes:
        if node.index in prims:
            p.primitive(node, prims[node.index])
        else:
            p.torch_node(node)
        for o, info in enumerate(node.outputs):
            ref = Ref("node", node.index, o)
            src = p.state[ref]
            if src.partial and (ref in returned or not info.shape):  # a loss: whole at once
                p.edge(-1, reduced, ref, Placed(src.layout))
                p.state[ref] = Placed(src.layout)
                reduced += 1
    return ParallelPlan(
        device_num=device_num,
        matrix=matrix,
        mode="semi_auto",
        inputs=arrive,
        nodes=tuple(p.nodes),
        edges=tuple(p.edges),
        params={
            n: ParamPlan(layout, graph.params[n].shape, graph.params[n].dtype)
            for n, layout in params.items()
        },
        input_shapes={k: v.shape for k, v in graph.inputs.items()},
        outputs=tuple(p.state[ref] for ref in graph.outputs),
    )


def _param_layouts(
    graph: Graph,
    prims: Mapping[int, OpPlan],
    given: Mapping[str, TensorLayout],
    matrix: DeviceMatrix,
    pinned: Mapping[str, TensorLayout],
) -> dict[str, TensorLayout]:
    """Each parameter's storage layout: declared, else its first primitive consumer's, else
    the layout its op-form annotated op reads it in (`pinned`), else whole."""
    out = {n: refine(t, matrix) for n, t in given.items()}
    for node in graph.nodes:
        if node.index not in prims:
            continue
        for ref, layout in zip(node.inputs, prims[node.index].inputs, strict=True):
            if ref.kind == "param":
                out.setdefault(str(ref.key), refine(layout, matrix))
    for name, layout in pinned.items():
        out.setdefault(name, layout)
    for name, info in graph.params.items():
        out.setdefault(name, TensorLayout(matrix, ((),) * len(info.shape)))
    return {n: out[n] for n in graph.params}
