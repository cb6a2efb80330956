"""semi_auto planning: annotated ops keep their strategies, every other op runs data parallel.

`plan_semi_auto(graph, device_num, ...)` makes a `ParallelPlan` from a captured `Graph`:

1. Each shardwise primitive is planned by its own rule (`ops.plan_primitive`: its ``shard()``
   strategy, or its data-parallel default); all their device matrices (and those of declared
   layouts, op-form annotations and ``sw.reshard`` nodes) are refined into one global matrix
   (`_placement._matrix`, by `common_refinement`).
2. Where every value starts: inputs split on dim 0 over all devices (MindSpore's
   ``"data_parallel"`` dataset strategy; ``"full_batch"``: whole, then sliced at entry; or the
   given per-input layouts: `_placement._input_state`), parameters in their declared layout or
   the layout their first primitive wants, else the one their op-form annotated op reads them
   in (`_Follow.pin`), else whole (`_placement._param_layouts`), buffers and constants whole.
3. Every node in order: a primitive takes its rule's layouts and runs its collectives
   (`Planner.primitive`); for a torch op (`Planner.torch_node`), an op annotated with
   ``sw.shard``'s op form takes its inputs as annotated (`_annotated.op_form`; `_Follow.pin`
   follows its aten program from there, so the bias, output and partial sums come from the
   rules, and stores its parameters that way), a ``sw.reshard`` node pins its value's layout,
   and every other op follows its inputs through its aten ops (`_Follow._follow`), asking the
   sharding rules (`ops.aten_rules.decide`: DTensor's, or shardwise's own) at each; from the
   data-parallel inputs this gives data-parallel ops (views that fold the batch dim, reductions
   over it and losses included: a mean over the batch is a partial value, all-reduced where it
   is consumed whole). When following would move the inputs (or the rule would move an
   intermediate value inside the op), `_Follow._cheaper` takes the data-parallel strategy
   if it moves fewer bytes (and when no rule takes the inputs as placed: a dropout's in-place
   random fill of a row-parallel output's partial sum); an op that can do neither runs
   replicated. An op's random in-place fills on split inputs are recorded with their
   placements (`_draws.plan_draws`: each rank draws the whole, keeps its block).
4. Every mismatch between a producer's placement and a consumer's becomes an `EdgePlan`
   (`Planner.edge`: AllReduce of partial values, then the cheapest Slice / AllGather /
   AlltoAll steps). A partial scalar (a loss, a sum over the batch) and a partial returned
   value are all-reduced right where they are made (consumer -1), so the loss is one value on
   every rank; a cross entropy / NLL mean is averaged by the targets each rank counted
   (`_losses.weighted_mean`: ``ignore_index``, class weights). A whole value that a consumer
   wants partial (the bias of a row-parallel ``F.linear``) is kept on the first rank of those
   axes and zero on the others (`EdgePlan.kept`). A fill (``torch.zeros``) whose every
   consumer cuts the same block is made as that block instead (`_local_factories.split_fills`).
5. `_backward.plan_backward`: where a replicated value's gradient is made the same on every
   replica (Megatron's ``f``) because that saves the adjoints of forward AllReduces and the
   gradient reduction of replicated parameters.
6. `_seeded.plan_seeded`: the AllReduces whose adjoint is local when ``loss.backward()`` starts
   with no gradient (every consumer of the reduced value runs alike on every rank, e.g.
   ``loss / accumulation_steps``); `_seeded.plan_deferred`: the weighted mean loss whose
   seeded backward need not wait for the summed count.

`PlanError` and `data_parallel` are `_placement`'s, importable from here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from shardwise.layout import DeviceMatrix, TensorLayout, refine
from shardwise.ops import OpPlan, plan_primitive
from shardwise.ops._spec_checks import fmt_strategy
from shardwise.planner._annotated import RESHARD, AnnotationError, op_form, reshard_layout
from shardwise.planner._backward import plan_backward
from shardwise.planner._functions import check_functions
from shardwise.planner._gc import gc_paused
from shardwise.planner._graph import Graph, Ref
from shardwise.planner._local_factories import split_fills
from shardwise.planner._losses import WEIGHTED_MEAN
from shardwise.planner._placement import (
    DatasetStrategy,
    Placements,
    PlanError,
    Shape,
    _input_state,
    _itemsize,
    _matrix,
    _param_layouts,
    check_rank_order,
    data_parallel,
    read_whole,
)
from shardwise.planner._plan import (
    EdgePlan,
    ParallelPlan,
    ParamPlan,
    Placed,
    Root,
    replicated,
)
from shardwise.planner._planner import Planner
from shardwise.planner._scatter import fuse_scatter
from shardwise.planner._seeded import plan_deferred, plan_seeded
from shardwise.redistribution import plan_redistribution


@dataclass
class Setup:
    """What every mode's planning starts from (`setup`): the planner on the global matrix, the
    inputs' arrival and entry cuts, the primitives' plans, the parameters' fixed layouts."""

    planner: Planner
    arrive: dict[str, Placed]
    entry: list[tuple[str, Placed]]
    prims: dict[int, OpPlan]
    given: dict[str, TensorLayout]  # declared / loaded, refined onto the matrix
    pinned: dict[str, TensorLayout]  # read by op-form annotated ops


def setup(
    graph: Graph,
    device_num: int,
    dataset: DatasetStrategy,
    param_layouts: Mapping[str, TensorLayout] | None,
    extra_matrices: Sequence[Shape],
    annotated_only: bool = False,
) -> Setup:
    """Plan the primitives by their rules (with `annotated_only`, only those with a ``shard()``
    strategy), refine every matrix into the global one, place the inputs, pin the op-form
    annotations."""
    prims = {
        n.index: plan_primitive(
            n.target,
            *[graph.info(r).shape for r in n.inputs],
            device_num=device_num,
            **dict(n.kwargs),
        )
        for n in graph.nodes
        if n.is_primitive and (not annotated_only or n.target.in_strategy is not None)
    }  # (an automatic mode chooses the others: their default strategy may not even fit)
    for k, op in prims.items():
        for i, layout in enumerate(op.inputs):
            check_rank_order(graph.nodes[k], f"input {i}'s Layout", layout.matrix)
    given = dict(param_layouts or {})
    # (what asks for a device matrix, as its error names it, and the matrix's shape)
    named = {k: _who(graph.nodes[k].name, op, graph.nodes[k].target) for k in prims}
    sources = [(named[k], op.matrix.shape) for k, op in prims.items()]
    as_layouts = {named[k] for k, op in prims.items() if _layout_given(graph.nodes[k].target)}
    sources += [(f"the device matrix {list(m)} asked for", m) for m in extra_matrices]
    if isinstance(dataset, Mapping):
        sources += [
            (f"the dataset strategy of input {k}", t.matrix.shape) for k, t in dataset.items()
        ]
    forms = _annotation_sources(graph, device_num, sources, as_layouts)
    sources += [(f"parameter {n!r}'s declared layout", t.matrix.shape) for n, t in given.items()]
    matrix = _matrix(sources, device_num, as_layouts)
    p = Planner(graph, device_num, matrix)
    arrive, entry = _input_state(p, graph, dataset, warn=not annotated_only)
    whole = read_whole(graph, prims)
    for key, dp in [e for e in entry if e[0] in whole]:  # (full_batch: kept whole, not cut)
        p.state[Ref("input", key)] = arrive[key]
        entry.remove((key, dp))
    p.given_blocks = {Ref("input", k) for k, placed in arrive.items() if placed.layout.used_axes()}
    for name, info in graph.buffers.items():  # (whole on every rank, known before planning)
        p.state[Ref("buffer", name)] = replicated(matrix, len(info.shape))
    for i, info in enumerate(graph.consts):
        p.state[Ref("const", i)] = replicated(matrix, len(info.shape))
    pinned: dict[str, TensorLayout] = {}
    for index, (_, layouts) in forms.items():
        for name, layout in p.pin(graph.nodes[index], layouts).items():
            pinned.setdefault(name, layout)
    given = {n: refine(t, matrix) for n, t in given.items()}
    return Setup(p, arrive, entry, prims, given, pinned)


def _annotation_sources(
    graph: Graph, device_num: int, sources: list[tuple[str, Shape]], as_layouts: set[str]
) -> dict[int, tuple[DeviceMatrix, dict[int, TensorLayout]]]:
    """The op forms of `graph` (``sw.shard`` on nn.Linear / nn.Embedding); adds their and the
    ``sw.reshard`` nodes' device matrices to `sources` (those given as Layout calls also to
    `as_layouts`)."""
    try:
        forms = {n.index: op_form(n, graph, device_num) for n in graph.nodes if n.strategy}
        for k, (m, _) in forms.items():
            check_rank_order(graph.nodes[k], "its sw.shard Layout", m)
            sources.append((f"{graph.nodes[k].name} (sw.shard's op form)", m.shape))
            if any(isinstance(e, TensorLayout) for e in graph.nodes[k].strategy or ()):
                as_layouts.add(sources[-1][0])
        for n in graph.nodes:
            if n.op == RESHARD:
                moved = reshard_layout(n, graph.info(n.inputs[0]).shape, device_num).matrix
                check_rank_order(n, "the sw.reshard Layout", moved)
                sources.append((f"{n.name} (sw.reshard)", moved.shape))
                if any(isinstance(a, TensorLayout) for a in (*n.args, *n.kwargs.values())):
                    as_layouts.add(sources[-1][0])
    except AnnotationError as e:
        raise PlanError(str(e)) from None
    return forms


def _who(name: str, op: OpPlan, prim: object) -> str:
    """A primitive as a device-matrix conflict names it: its node name and strategy (as the
    user gave it: split counts or Layout calls)."""
    given = getattr(prim, "in_strategy", None)
    if op.user_set and given is not None:
        return f"{name} with strategy {fmt_strategy(given)}"
    strategy = tuple(tuple(t.split_count(d) for d in range(t.ndim)) for t in op.inputs)
    return f"{name} with its default strategy {strategy}"


def _layout_given(prim: object) -> bool:
    """Whether a primitive's strategy is made of Layout calls."""
    given = getattr(prim, "in_strategy", None) or ()
    return any(isinstance(e, TensorLayout) for e in given)


def walk(
    graph: Graph,
    s: Setup,
    params: Mapping[str, TensorLayout],
    mode: str,
    rules: Mapping[int, str] | None = None,
) -> ParallelPlan:
    """Place every value as the decisions say (the primitives' plans in ``s.prims``, torch ops
    as ``s.planner.chosen`` says or by following their inputs), make the edges, the loss's
    reduction and the backward's equal gradients, and return the plan (`rules`: a primitive
    node's rule label other than its plan's)."""
    p = s.planner
    matrix = p.matrix
    for name, layout in params.items():
        p.state[Ref("param", name)] = Placed(layout)
    for k, (key, dp) in enumerate(s.entry):
        info = graph.inputs[key]
        src = s.arrive[key]
        steps = plan_redistribution(src.layout, dp.layout, info.shape, _itemsize(info.dtype))
        edge = EdgePlan(-2, k, f"input:{key}", info.shape, src, dp, steps.steps, dtype=info.dtype)
        p.edges.append(edge)
    returned = set(graph.outputs)
    reduced = 0
    for node in graph.nodes:
        if node.index in s.prims:
            p.primitive(node, s.prims[node.index], (rules or {}).get(node.index))
        else:
            p.torch_node(node)
        for o, info in enumerate(node.outputs):
            ref = Ref("node", node.index, o)
            src = p.state[ref]
            if src.partial and (ref in returned or not info.shape):  # a loss: whole at once
                p.edge(-1, reduced, ref, Placed(src.layout))
                if p.nodes[-1].local == WEIGHTED_MEAN:  # (the pair: `EdgePlan.weighted`)
                    p.edges[-1] = replace(p.edges[-1], weighted=True)
                p.state[ref] = Placed(src.layout)
                reduced += 1
    nodes, edges = split_fills(graph, p.nodes, p.edges)  # (a zeros read split: made so)
    nodes, edges, equal = plan_backward(graph, nodes, edges, params, matrix)
    edges = plan_deferred(nodes, plan_seeded(graph, nodes, edges))
    check_functions(graph, nodes, edges)
    edges = fuse_scatter(edges)
    return ParallelPlan(
        device_num=p.device_num,
        matrix=matrix,
        mode=mode,
        inputs=s.arrive,
        nodes=nodes,
        edges=edges,
        params={
            n: ParamPlan(layout, graph.params[n].shape, graph.params[n].dtype)
            for n, layout in params.items()
        },
        input_shapes={k: v.shape for k, v in graph.inputs.items()},
        outputs=tuple(p.state[ref] for ref in graph.outputs),
        equal_grads=equal,
        roots=tuple(Root(str(ref), p.state[ref]) for ref in graph.roots),
        regions=graph.regions,
        frozen=tuple(n for n in graph.frozen if n in params),
        set_buffers={n: str(ref) for n, ref in graph.set_buffers.items()},
    )


@gc_paused
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
    s = setup(graph, device_num, dataset, param_layouts, extra_matrices)
    params = _param_layouts(graph, s.prims, s.given, s.planner.matrix, s.pinned)
    return walk(graph, s, params, "semi_auto")


__all__ = [
    "DatasetStrategy",
    "Placements",
    "PlanError",
    "Shape",
    "data_parallel",
    "plan_semi_auto",
]
