"""The sharding-rule registry: ``RULES[primitive name] -> rule``, one rule per family.

A rule is a pure function ``rule(op_args, in_strategy, out_strategy, input_shapes, device_num,
who) -> OpPlan`` (see `shardwise.ops._plan.Rule`). Families share one rule, listed in `FAMILIES`:

==============  ======================================  ==========================================
family          primitives                              forward communication
==============  ======================================  ==========================================
matmul          MatMul, BatchMatMul                     split K -> AllReduce over K's axes, or
                                                        ReduceScatter on dim 0 (out_strategy)
broadcast       Add, Sub, Mul, Div                      none (broadcast dims never split)
unary           ReLU, GeLU, Sigmoid, Tanh, Dropout      none
softmax         Softmax, LogSoftmax                     none (the axis may not be split)
bias_add        BiasAdd                                 none (bias split like the channel dim)
layer_norm      LayerNorm                               none (normalized dims may not be split)
reduce          ReduceSum, ReduceMean                   split reduced dim -> AllReduce sum / mean
softmax_ce      SoftmaxCrossEntropyWithLogits           none (the class dim may not be split)
gather          Gather                                  params split on axis -> masked lookup +
                                                        AllReduce (or ReduceScatter, axis 0)
transpose       Transpose                               none
reshape         Reshape, Flatten                        none (merged dims: outermost split only)
==============  ======================================  ==========================================

Each rule builds the call's `Spec` (`shardwise.ops._specs`) and hands it to `plan_spec`
(`shardwise.ops._spec`); Gather adds its own constraints (`gather_rule`). `plan_primitive` plans
one primitive module for given input shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardwise.ops._plan import OpPlan, Rule, Shape, Strategy
from shardwise.ops._spec import plan_spec
from shardwise.ops._specs import (
    SpecBuilder,
    bias_add_spec,
    broadcast_spec,
    gather_spec,
    layer_norm_spec,
    matmul_spec,
    reduce_spec,
    reshape_spec,
    softmax_ce_spec,
    softmax_spec,
    transpose_spec,
    unary_spec,
)

if TYPE_CHECKING:
    from shardwise.ops._base import Primitive


def _shapes(input_shapes: Sequence[Sequence[int]]) -> list[Shape]:
    return [tuple(int(s) for s in shape) for shape in input_shapes]


def spec_rule(builder: SpecBuilder) -> Rule:
    """The rule of a family whose plan follows from its `Spec` alone."""

    def rule(
        op_args: Mapping[str, Any],
        in_strategy: Strategy | None,
        out_strategy: Strategy | None,
        input_shapes: Sequence[Sequence[int]],
        device_num: int,
        who: str,
    ) -> OpPlan:
        shapes = _shapes(input_shapes)
        spec = builder(op_args, shapes, who)
        return plan_spec(spec, in_strategy, out_strategy, shapes, device_num, who)

    rule.__name__ = builder.__name__.replace("_spec", "_rule")
    rule.__doc__ = f"The sharding rule built from `{builder.__name__}`."
    return rule


def gather_rule(
    op_args: Mapping[str, Any],
    in_strategy: Strategy | None,
    out_strategy: Strategy | None,
    input_shapes: Sequence[Sequence[int]],
    device_num: int,
    who: str,
) -> OpPlan:
    """Gather: the generic plan, plus MindSpore's constraints when the params are split on the
    gathered axis (a masked lookup: each rank looks up the rows it holds, zeros elsewhere, then
    AllReduce): params of 1 or 2 dims, indices not split.

    Example:
        >>> gather_rule({"op": "Gather", "axis": 0}, ((8, 1), (1, 1)), None,
        ...             [(1024, 64), (4, 16)], 8, "embedding").comms
        (Comm(kind='AllReduce', axes=('d0',), dim=None, op='sum', output=0),)
    """
    plan = spec_rule(gather_spec)(op_args, in_strategy, out_strategy, input_shapes, device_num, who)
    if not plan.comms:
        return dataclasses.replace(plan, local="")
    params, indices = plan.inputs
    label = who if plan.user_set else f"{who} (default data-parallel strategy)"
    if params.ndim > 2:
        raise ValueError(
            f"{label}: input 0 (input_params) is split on the gathered axis, which needs params "
            f"of 1 or 2 dims, got {list(plan.input_shapes[0])}; do not split that axis"
        )
    split = [d for d in range(indices.ndim) if indices.split_count(d) > 1]
    if split:
        d = split[0]
        raise ValueError(
            f"{label}: input 0 (input_params) is split on the gathered axis (masked lookup + "
            f"AllReduce), so input 1 (input_indices) cannot be split too, but its dim {d} is "
            f"split into {indices.split_count(d)}; valid: 1 for every indices dim, or do not "
            f"split the params' gathered axis"
        )
    return plan


FAMILIES: dict[str, tuple[Rule, tuple[str, ...]]] = {
    "matmul": (spec_rule(matmul_spec), ("MatMul", "BatchMatMul")),
    "broadcast": (spec_rule(broadcast_spec), ("Add", "Sub", "Mul", "Div")),
    "unary": (spec_rule(unary_spec), ("ReLU", "GeLU", "Sigmoid", "Tanh", "Dropout")),
    "softmax": (spec_rule(softmax_spec), ("Softmax", "LogSoftmax")),
    "bias_add": (spec_rule(bias_add_spec), ("BiasAdd",)),
    "layer_norm": (spec_rule(layer_norm_spec), ("LayerNorm",)),
    "reduce": (spec_rule(reduce_spec), ("ReduceSum", "ReduceMean")),
    "softmax_ce": (spec_rule(softmax_ce_spec), ("SoftmaxCrossEntropyWithLogits",)),
    "gather": (gather_rule, ("Gather",)),
    "transpose": (spec_rule(transpose_spec), ("Transpose",)),
    "reshape": (spec_rule(reshape_spec), ("Reshape", "Flatten")),
}
"""Family -> (its rule, the primitives that use it)."""

RULES: dict[str, Rule] = {op: rule for rule, ops in FAMILIES.values() for op in ops}
"""Primitive name -> its sharding rule."""


def plan_primitive(
    module: Primitive,
    *input_shapes: Sequence[int],
    device_num: int,
    **call_args: Any,
) -> OpPlan:
    """Plan one primitive module (its `shard()` strategies, or the default) for input shapes.

    Args:
        module: a shardwise primitive (``sw.ops.MatMul()...``).
        *input_shapes: the global shape of each tensor input, in call order.
        device_num: devices in the job (or pipeline stage).
        **call_args: the non-tensor call arguments (``axis`` for ReduceSum / Gather, ``perm``
            for Transpose, ``shape`` for Reshape).

    Returns:
        The `OpPlan`.

    Raises:
        ValueError: an invalid strategy, naming the primitive's module path.

    Example:
        >>> mm = MatMul().shard(((2, 4), (4, 1)))
        >>> print(plan_primitive(mm, (32, 784), (784, 512), device_num=8))
        MatMul [d0=2, d1=4, d2=1]: (d0, d1), (d1, None) -> (d0, None); AllReduce(sum) over d1
    """
    rule = RULES[module.name]
    return rule(
        module.op_args(**call_args),
        module.in_strategy,
        module.out_strategy,
        input_shapes,
        device_num,
        module.who,
    )
