"""Every valid strategy of a primitive call: the candidates an automatic planner chooses from.

`candidate_strategies(module, *shapes, device_num, **call_args)` builds the call's `Spec` (the
builder its rule was made from: ``rule.spec_builder``), gives each logical axis that may be
split (not `fixed`, used by an input) a split count, such that the counts multiply to a
divisor of `device_num` and every dim on an axis divides by its count, writes that as a tuple
strategy (one entry per input) and keeps those the rule itself accepts (Gather's extra
constraints included). Strategies that use every device come first (MindSpore generates
those; the others repeat the computation on some devices).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from shardwise.ops._plan import OpPlan, Strategy
from shardwise.ops.rules import RULES

if TYPE_CHECKING:
    from shardwise.ops._base import Primitive


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _counts(
    axes: Sequence[int], sizes: dict[int, list[int]], budget: int
) -> Iterator[dict[int, int]]:
    """Every assignment of a split count to each of `axes` whose product divides `budget` and
    that divides every dim size on its axis (`sizes`)."""
    if not axes:
        yield {}
        return
    first, rest = axes[0], axes[1:]
    for c in _divisors(budget):
        if any(s % c for s in sizes[first]):
            continue
        for more in _counts(rest, sizes, budget // c):
            yield {first: c, **more}


def candidate_strategies(
    module: Primitive, *input_shapes: Sequence[int], device_num: int, **call_args: Any
) -> list[tuple[Strategy, OpPlan]]:
    """Every strategy of `module`'s call that its rule accepts, with the rule's plan.

    Args:
        module: the primitive (its own ``shard()`` strategy is ignored).
        *input_shapes: each tensor input's global shape.
        device_num: the job's size.
        **call_args: the non-tensor call arguments (as `plan_primitive` takes them).

    Returns:
        (strategy, plan) pairs: those using all `device_num` devices first, then the others,
        each group in enumeration order. A primitive whose rule has no spec builder gets its
        data-parallel default only.

    Example:
        >>> [s for s, _ in candidate_strategies(MatMul(), (16, 32), (32, 16), device_num=2)]
        [((1, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 1), (1, 1)), ((1, 1), (1, 1))]
    """
    rule = RULES[module.name]
    shapes = [tuple(int(s) for s in shape) for shape in input_shapes]
    op_args = module.op_args(**call_args)
    builder = getattr(rule, "spec_builder", None)
    if builder is None:
        plan = rule(op_args, None, None, shapes, device_num, module.who)
        return [(tuple(tuple(1 for _ in s) for s in shapes), plan)]
    spec = builder(op_args, shapes, module.who)
    sizes: dict[int, list[int]] = {}
    for dims, shape in zip(spec.inputs, shapes, strict=True):
        for lg, size in zip(dims, shape, strict=True):
            if lg is not None and lg not in spec.fixed:
                sizes.setdefault(lg, []).append(size)
    full: list[tuple[Strategy, OpPlan]] = []
    partial: list[tuple[Strategy, OpPlan]] = []
    for counts in _counts(sorted(sizes), sizes, device_num):
        strategy = tuple(
            tuple(1 if lg is None else counts.get(lg, 1) for lg in dims) for dims in spec.inputs
        )
        try:
            plan = rule(op_args, strategy, None, shapes, device_num, module.who)
        except ValueError:
            continue
        used = 1
        for c in counts.values():
            used *= c
        (full if used == device_num else partial).append((strategy, plan))
    return full + partial
