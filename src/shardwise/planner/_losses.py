"""Mean losses over rows split across ranks: which ones the plan averages by counted targets.

``F.cross_entropy`` / ``F.nll_loss`` with ``reduction="mean"`` and class-index targets divide
their sum by the targets they count: those not equal to ``ignore_index``, each weighted by its
class's ``weight``. Split over ranks, the ranks may count differently (padding in some rows
only), and the mean of the ranks' means is then not the single-device mean. `weighted_mean`
tells the planner which loss nodes the executor must average by their counted weight instead
(`NodePlan.local` = `WEIGHTED_MEAN`; each rank runs the loss as a sum, and its AllReduce then
carries the pair (sum, weight): `communication.primitives.sum_over_ranks`).

Two more losses divide inside torch by a count of their rows, which each rank takes from its
own rows: ``F.kl_div(reduction="batchmean")`` (by ``input.size(0)``) and ``F.cross_entropy``
with class probabilities as targets and ``reduction="mean"`` (by ``input.numel() /
input.size(1)``, the rows times any extra dims). Their rule, made on global shapes, sums the
ranks' values as if each had divided by the global count: N times the loss. They are averaged
by their rows the same way (`batch_mean`) when their rows are the only split dim.
"""

from __future__ import annotations

from shardwise.planner._graph import Graph, Node
from shardwise.planner._placed import Placed

WEIGHTED_MEAN = "weighted_mean"
"""`NodePlan.local` of a mean loss the executor averages by its counted targets."""

LOSSES = {"torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss"}
LOSS_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
"""The parameters both losses start with, in order (`parallel/_local.loss_weight` reads them)."""

KL_DIV = "torch.nn.functional.kl_div"
KL_ARGS = ("input", "target", "size_average", "reduce", "reduction", "log_target")
"""``F.kl_div``'s parameters, in order."""


def _argument(node: Node, name: str, default: object, names: tuple[str, ...] = LOSS_ARGS) -> object:
    if name in node.kwargs:
        return node.kwargs[name]
    at = names.index(name)
    return node.args[at] if len(node.args) > at else default


def weighted_mean(node: Node, out: Placed, graph: Graph, ins: tuple[Placed, ...] = ()) -> bool:
    """Whether loss node `node` of `graph`, whose output is placed `out` (its inputs `ins`), is
    a mean over split rows that the ranks count (`batch_mean`), or may count differently.

    Example:
        >>> weighted_mean(node, plan_node.outputs[0], graph)  # doctest: +SKIP
        True
    """
    if batch_mean(node, out, graph, ins):
        return True
    if node.op not in LOSSES or len(node.inputs) < 2 or not out.partial or out.reduce != "avg":
        return False
    if _argument(node, "size_average", None) is not None:
        return False
    if _argument(node, "reduce", None) is not None:
        return False
    target = graph.info(node.inputs[1])
    return _argument(node, "reduction", "mean") == "mean" and target.dtype.startswith(
        ("int", "uint")
    )


def batch_mean(node: Node, out: Placed, graph: Graph, ins: tuple[Placed, ...]) -> bool:
    """Whether `node` is a loss that divides by its own rows inside torch (``kl_div``'s
    batchmean, a cross entropy of class probabilities), with its input split on dim 0 only,
    over the axes its partial output is summed on."""
    names: tuple[str, ...]
    if node.op == KL_DIV:
        names = KL_ARGS
        if _argument(node, "reduction", "mean", names) != "batchmean":
            return False
    elif node.op == "torch.nn.functional.cross_entropy" and len(node.inputs) >= 2:
        names = LOSS_ARGS
        probabilities = graph.info(node.inputs[1]).dtype.startswith(("float", "bfloat"))
        if _argument(node, "reduction", "mean") != "mean" or not probabilities:
            return False
    else:
        return False
    if _argument(node, "size_average", None, names) is not None:
        return False
    if _argument(node, "reduce", None, names) is not None or not ins or not out.partial:
        return False
    m, dims = ins[0].layout.matrix, ins[0].layout.dims
    rows = {a for a in (dims[0] if dims else ()) if m.shape[a] > 1}
    others = any(m.shape[a] > 1 for d in dims[1:] for a in d)
    return bool(rows) and not others and rows == {a for a in out.partial if m.shape[a] > 1}
