"""Mean losses over rows split across ranks: which ones the plan averages by counted targets.

``F.cross_entropy`` / ``F.nll_loss`` with ``reduction="mean"`` and class-index targets divide
their sum by the targets they count: those not equal to ``ignore_index``, each weighted by its
class's ``weight``. Split over ranks, the ranks may count differently (padding in some rows
only), and the mean of the ranks' means is then not the single-device mean. `weighted_mean`
tells the planner which loss nodes the executor must average by their counted weight instead
(`NodePlan.local` = `WEIGHTED_MEAN`; the loss's AllReduce then carries the pair (value x
weight, weight): `communication.primitives.sum_over_ranks`).
"""

from __future__ import annotations

from shardwise.planner._graph import Graph, Node
from shardwise.planner._placed import Placed

WEIGHTED_MEAN = "weighted_mean"
"""`NodePlan.local` of a mean loss the executor averages by its counted targets."""

LOSSES = {"torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss"}
LOSS_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
"""The parameters both losses start with, in order (`parallel/_local.loss_weight` reads them)."""


def _argument(node: Node, name: str, default: object) -> object:
    if name in node.kwargs:
        return node.kwargs[name]
    at = LOSS_ARGS.index(name)
    return node.args[at] if len(node.args) > at else default


def weighted_mean(node: Node, out: Placed, graph: Graph) -> bool:
    """Whether loss node `node` of `graph`, whose output is placed `out`, is a mean over split
    rows that the ranks may count differently.

    Example:
        >>> weighted_mean(node, plan_node.outputs[0], graph)  # doctest: +SKIP
        True
    """
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
