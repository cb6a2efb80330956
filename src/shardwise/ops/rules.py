"""The sharding-rule registry: ``RULES[primitive name] -> rule``, one rule per family.

A rule is a pure function ``rule(op_args, in_strategy, out_strategy, input_shapes, device_num,
who) -> OpPlan`` (see `shardwise.ops._plan.Rule`). Families share one rule, listed in `FAMILIES`:

==============  ======================================  ==========================================
family          primitives                              forward communication
==============  ======================================  ==========================================
matmul          MatMul, BatchMatMul                     split K -> AllReduce over K's axes, or
                                                        ReduceScatter on dim 0 (out_strategy)
broadcast       Add, Sub, Mul, Div                      none (broadcast dims never split)
unary           ReLU, GeLU, Sigmoid, Tanh, Exp, Log,    none
                Cast, Dropout
softmax         Softmax, LogSoftmax                     none (the axis may not be split)
bias_add        BiasAdd                                 none (bias split like the channel dim)
layer_norm      LayerNorm                               none (normalized dims may not be split)
reduce          ReduceSum, ReduceMean, ReduceMax        split reduced dim -> AllReduce sum / mean
                                                        / max
softmax_ce      SoftmaxCrossEntropyWithLogits           none (the class dim may not be split)
gather          Gather                                  params split on axis -> masked lookup +
                                                        AllReduce (or ReduceScatter, axis 0)
transpose       Transpose                               none
reshape         Reshape, Flatten                        none (merged dims: outermost split only)
conv2d          Conv2D                                  split C_in -> AllReduce sum; H, W and the
                                                        kernel dims never split (halo exchange)
pool            MaxPool, AvgPool                        none (H, W never split)
batch_norm      BatchNorm                               none after the op; in training, inside it,
                                                        the batch statistics gathered over N/H/W
==============  ======================================  ==========================================

Each rule builds the call's `Spec` (`shardwise.ops._specs`) and hands it to `plan_spec`
(`shardwise.ops._spec`); Gather adds its own constraints (`gather_rule`), Conv2D its kernel dims
(`conv2d_rule`). `plan_primitive` plans one primitive module for given input shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardwise.layout import TensorLayout
from shardwise.ops._cnn_specs import batch_norm_spec, conv2d_spec, pool_spec
from shardwise.ops._plan import OpPlan, Rule, Shape, Strategy
from shardwise.ops._spec import Spec, plan_spec
from shardwise.ops._spec_checks import fmt_strategy
from shardwise.ops._spec_fixes import Plans, planning
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
    rule.spec_builder = builder  # type: ignore[attr-defined]  # (`_candidates`)
    return rule


def _split_dims(entry: object) -> list[int]:
    """The dims an int strategy entry splits (none for a Layout entry: see the plan)."""
    return [d for d, v in enumerate(entry) if v != 1] if isinstance(entry, tuple) else []


def batch_and_rows(op_args: Mapping[str, Any], in_strategy: Strategy | None) -> bool:
    """Whether an int strategy is MindSpore's vocabulary-parallel embedding with a split batch:
    axis 0, no batch dims, the params split on dim 0 only and the indices on dim 0 only
    (``((mp, 1), (dp, 1))``). Its device matrix is the indices' axes first (outer), then the
    params' (``[dp, mp]``): the batch split like the data-parallel ops around it, the rows inside
    each batch group."""
    if in_strategy is None or len(in_strategy) != 2 or op_args.get("batch_dims", 0) != 0:
        return False
    params, indices = in_strategy
    if not isinstance(params, tuple) or not _split_dims(params) == [0] == _split_dims(indices):
        return False
    return op_args.get("axis") in (0, -len(params))


def _indices_first(spec: Spec, p: int, q: int) -> Spec:
    """`spec` with the indices' logical axes numbered before the params' (axis 0, no batch
    dims: the indices' dims are ``p .. p+q-1``)."""
    new = {**{d: q + d for d in range(p)}, **{p + d: d for d in range(q)}}

    def dims(ds: Sequence[int | None]) -> tuple[int | None, ...]:
        return tuple(None if d is None else new[d] for d in ds)

    return dataclasses.replace(
        spec,
        inputs=tuple(dims(ds) for ds in spec.inputs),
        outputs=tuple(dims(ds) for ds in spec.outputs),
        reduced=tuple(new[d] for d in spec.reduced),
        fixed={new[d]: why for d, why in spec.fixed.items()},
        roles={new[d]: role for d, role in spec.roles.items()},
        batch=None if spec.batch is None or spec.batch < 0 else new[spec.batch],
    )


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
    AllReduce): params of 1 or 2 dims, indices not split, except MindSpore's split batch
    (`batch_and_rows`: params split on axis 0 only, indices on dim 0 only; the device matrix
    puts the indices' split outer).

    Example:
        >>> gather_rule({"op": "Gather", "axis": 0}, ((8, 1), (1, 1)), None,
        ...             [(1024, 64), (4, 16)], 8, "embedding").comms
        (Comm(kind='AllReduce', axes=('d0',), dim=None, op='sum', output=0),)
        >>> gather_rule({"op": "Gather", "axis": 0}, ((4, 1), (2, 1)), None,
        ...             [(1024, 64), (4, 16)], 8, "embedding").comms
        (Comm(kind='AllReduce', axes=('d2',), dim=None, op='sum', output=0),)
    """
    shapes = _shapes(input_shapes)
    spec = gather_spec(op_args, shapes, who)
    if batch_and_rows(op_args, in_strategy):
        spec = _indices_first(spec, len(shapes[0]), len(shapes[1]))
    plans = _rule_plans(gather_rule, op_args, input_shapes, device_num, who)
    plan = plan_spec(spec, in_strategy, out_strategy, shapes, device_num, who, plans)
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
    params_split = [d for d in range(params.ndim) if params.split_count(d) > 1]
    if split and not (split == [0] and params_split == [0]):
        d = split[-1]
        raise ValueError(
            f"{label}: input 0 (input_params) is split on the gathered axis (masked lookup + "
            f"AllReduce), so input 1 (input_indices) cannot be split too, but its dim {d} is "
            f"split into {indices.split_count(d)}; valid: 1 for every indices dim, or (axis 0, "
            f"params split on dim 0 only) a split of indices dim 0 only, e.g. ((4, 1), (2, 1))"
        )
    return plan


gather_rule.spec_builder = gather_spec  # type: ignore[attr-defined]  # (`_candidates`)


def conv2d_rule(
    op_args: Mapping[str, Any],
    in_strategy: Strategy | None,
    out_strategy: Strategy | None,
    input_shapes: Sequence[Sequence[int]],
    device_num: int,
    who: str,
) -> OpPlan:
    """Conv2D: the generic plan (`conv2d_spec`), after checking that the weight's kernel dims
    (kh, kw) are not split: a block of a kernel would need the input rows of the others.

    Example:
        >>> conv2d_rule({"op": "Conv2D", "out_channel": 8, "kernel_size": 3},
        ...             ((1, 4, 1, 1), (2, 4, 1, 1)), None, [(8, 16, 9, 9), (8, 16, 3, 3)],
        ...             8, "conv").comms
        (Comm(kind='AllReduce', axes=('d1',), dim=None, op='sum', output=0),)
    """
    shapes = _shapes(input_shapes)
    spec = conv2d_spec(op_args, shapes, who)
    plans = _rule_plans(conv2d_rule, op_args, input_shapes, device_num, who)
    if in_strategy is not None and len(in_strategy) == 2:
        weight = in_strategy[1]
        for d, what in ((2, "kernel height kh"), (3, "kernel width kw")):
            if isinstance(weight, TensorLayout):
                n = weight.split_count(d) if d < weight.ndim else 1
                fix = "'None' for that dim"
            else:
                n = weight[d] if d < len(weight) else 1
                fix = _kernel_fix(in_strategy, plans)
            if n > 1:
                raise ValueError(
                    f"{who}: input 1 (weight) dim {d} is the {what} of Conv2D and cannot be split, "
                    f"but the strategy splits it into {n}; valid: {fix}"
                )
    return plan_spec(spec, in_strategy, out_strategy, shapes, device_num, who, plans)


def _kernel_fix(in_strategy: Strategy, plans: Plans) -> str:
    """Conv2D's int strategy with the kernel dims whole, where that plans; else what to change."""
    x, weight = in_strategy
    if isinstance(x, tuple) and isinstance(weight, tuple):
        for fix in planning([[(x, (*weight[:2], 1, 1))]], plans):
            return fmt_strategy(list(fix))
    return "1 for weight dims 2 and 3 (kh and kw), and the other splits changed as well"


def _rule_plans(
    rule: Rule,
    op_args: Mapping[str, Any],
    input_shapes: Sequence[Sequence[int]],
    device_num: int,
    who: str,
) -> Plans:
    """`rule` on one strategy (no out_strategy): what a suggested fix must pass."""

    def plans(strategy: Strategy) -> OpPlan:
        return rule(op_args, strategy, None, input_shapes, device_num, who)

    return plans


conv2d_rule.spec_builder = conv2d_spec  # type: ignore[attr-defined]  # (`_candidates`)

FAMILIES: dict[str, tuple[Rule, tuple[str, ...]]] = {
    "matmul": (spec_rule(matmul_spec), ("MatMul", "BatchMatMul")),
    "broadcast": (spec_rule(broadcast_spec), ("Add", "Sub", "Mul", "Div")),
    "unary": (
        spec_rule(unary_spec),
        ("ReLU", "GeLU", "Sigmoid", "Tanh", "Exp", "Log", "Cast", "Dropout"),
    ),
    "softmax": (spec_rule(softmax_spec), ("Softmax", "LogSoftmax")),
    "bias_add": (spec_rule(bias_add_spec), ("BiasAdd",)),
    "layer_norm": (spec_rule(layer_norm_spec), ("LayerNorm",)),
    "reduce": (spec_rule(reduce_spec), ("ReduceSum", "ReduceMean", "ReduceMax")),
    "softmax_ce": (spec_rule(softmax_ce_spec), ("SoftmaxCrossEntropyWithLogits",)),
    "gather": (gather_rule, ("Gather",)),
    "transpose": (spec_rule(transpose_spec), ("Transpose",)),
    "reshape": (spec_rule(reshape_spec), ("Reshape", "Flatten")),
    "conv2d": (conv2d_rule, ("Conv2D",)),
    "pool": (spec_rule(pool_spec), ("MaxPool", "AvgPool")),
    "batch_norm": (spec_rule(batch_norm_spec), ("BatchNorm",)),
}
"""Family -> (its rule, the primitives that use it)."""

RULES: dict[str, Rule] = {op: rule for rule, ops in FAMILIES.values() for op in ops}
"""Primitive name -> its sharding rule."""


_SCALAR_OK = ("Add", "Sub", "Mul", "Div")


def _with_scalar(module: Any, shapes: Sequence[Sequence[int]]) -> Any:
    """An elementwise binary op's strategy, with ``()`` added for its one 0-d input (a Python
    number it was called with) when the strategy names the other input's entry only."""
    given = module.in_strategy
    zero = [i for i, s in enumerate(shapes) if not s]
    if module.name not in _SCALAR_OK or given is None or len(given) != 1 or len(zero) != 1:
        return given
    entry = given[0]
    out = list(given)
    out.insert(zero[0], () if isinstance(entry, tuple) else TensorLayout(entry.matrix, ()))
    return tuple(out)


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
            for Transpose, ``shape`` for Reshape, ``dtype`` for Cast).

    Returns:
        The `OpPlan`.

    Raises:
        ValueError: an invalid strategy, naming the primitive's module path; device_num < 1.
        TypeError: device_num is not an int.

    Example:
        >>> mm = MatMul().shard(((2, 4), (4, 1)))
        >>> print(plan_primitive(mm, (32, 784), (784, 512), device_num=8))
        MatMul [d0=2, d1=4, d2=1]: (d0, d1), (d1, None) -> (d0, None); AllReduce(sum) over d1
    """
    if isinstance(device_num, bool) or not isinstance(device_num, int):
        raise TypeError(
            f"{module.who}: plan_primitive's device_num={device_num!r} must be an int >= 1 "
            "(the devices of the job or pipeline stage)"
        )
    if device_num < 1:
        raise ValueError(
            f"{module.who}: plan_primitive's device_num={device_num} must be >= 1 (the devices "
            "of the job or pipeline stage)"
        )
    rule = RULES[module.name]
    return rule(
        module.op_args(**call_args),
        _with_scalar(module, input_shapes),
        module.out_strategy,
        input_shapes,
        device_num,
        module.who,
    )
