"""Which parameters optimizer parallel level 3 gathers again in backward.

Level 3 frees a bucket's gathered weights after the forward; backward gathers the bucket again
when it needs a member's weight: one autograd saved (`saved_params`: a multiplicand of an op
with another input needing a gradient, a MatMul's weight), or one a checkpointed region's
recomputation reads (`ParallelPlan.regions`). `regathered_params` is both; the reports and
`_plan_cost.step_cost` count one more AllGather for each bucket holding one.
"""

from __future__ import annotations

from shardwise.planner._plan import ParallelPlan

_BIAS_SLOT = {
    "linear": 2,
    "conv1d": 2,
    "conv2d": 2,
    "conv3d": 2,
    "conv_transpose1d": 2,
    "conv_transpose2d": 2,
    "conv_transpose3d": 2,
}
"""The tensor input of these torch functions that is a bias (``F.linear(x, w, b)``)."""

_UNSAVED = frozenset(
    [
        "add",
        "sub",
        "Add",
        "Sub",
        "BiasAdd",
        "TensorAdd",
        "Gather",
        "embedding",
        "index_select",
        "EmbeddingLookup",
    ]
)
"""Ops that save none of their parameter inputs for backward (the last part of the name)."""


def saved_params(plan: ParallelPlan, needs: set[str]) -> set[str]:
    """The parameters autograd saves for backward: inputs of an op that multiplies them with
    another input needing a gradient (a MatMul's weight; not the first layer's, whose input
    needs none, though its bias does, nor an Add's or a lookup's table). Level 3 gathers
    these again in backward."""
    out = set()
    for n in plan.nodes:
        short = n.op.rsplit(".", 1)[-1]
        if short in _UNSAVED:
            continue
        added = _BIAS_SLOT.get(short)  # (a bias is added: neither saved nor a multiplicand)
        factors = [w for i, w in enumerate(n.values) if i != added]
        for v in factors:
            others = [w for w in factors if w != v]
            if v.startswith("param:") and any(w in needs for w in others):
                out.add(v.removeprefix("param:"))
    return out


def regathered_params(plan: ParallelPlan) -> set[str]:
    """The parameters a level-3 backward needs whole again: those autograd saves
    (`saved_params`) and those a checkpointed region's recomputation reads.

    Example:
        >>> sorted(regathered_params(plan))  # doctest: +SKIP
        ['fc1.bias', 'fc1.weight', 'fc2.weight']
    """
    out = saved_params(plan, plan.gradient_values())
    for region in plan.regions:
        for k in region.replayed():
            out.update(
                v.removeprefix("param:") for v in plan.nodes[k].values if v.startswith("param:")
            )
    return out
