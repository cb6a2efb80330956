"""Every strategy a refused strategy's message lists as valid plans: for that op, those shapes
and that device count (a seeded sweep, and the cases a reviewer's fuzzer found refused)."""

from __future__ import annotations

import ast
import random
from typing import Any

import pytest

import shardwise as sw
from shardwise.ops import (
    Add,
    BatchMatMul,
    BiasAdd,
    LayerNorm,
    MatMul,
    Mul,
    Softmax,
    SoftmaxCrossEntropyWithLogits,
    plan_primitive,
)

Case = tuple[type, list[tuple[int, ...]]]

CASES: list[Case] = [
    (Add, [(8, 8), (8, 8)]),
    (Add, [(8, 1), (8, 8)]),
    (Add, [(8, 8), (8,)]),
    (Mul, [(2, 8), (2, 8)]),
    (MatMul, [(4, 16), (16, 8)]),
    (BatchMatMul, [(4, 8, 8), (4, 8, 8)]),
    (Softmax, [(8, 8)]),
    (LayerNorm, [(8, 16), (16,), (16,)]),
    (SoftmaxCrossEntropyWithLogits, [(8, 16), (8, 16)]),
    (BiasAdd, [(8, 16), (16,)]),
]


def refusal(cls: type, shapes: list[tuple[int, ...]], strategy: Any, n: int) -> str | None:
    """The message refusing `strategy` on `n` devices, or None where it plans."""
    try:
        plan_primitive(cls().shard(strategy), *shapes, device_num=n)
    except ValueError as e:
        return str(e)
    return None


def suggested(message: str) -> list[Any]:
    """The strategies the message lists after ``valid:`` (none where it says what to change in
    words)."""
    listed = message.split("valid: ")[1].split(" (not ")[0]
    if not listed.startswith("(("):
        return []
    return [ast.literal_eval(s) for s in listed.split(" or ")]


def sweep() -> list[tuple[Case, Any, int]]:
    rng = random.Random(33)
    return [
        (case, tuple(tuple(rng.choice((1, 2, 4, 8)) for _ in s) for s in case[1]), n)
        for case in CASES
        for n in (4, 8)
        for _ in range(12)
    ]


def test_every_suggested_strategy_plans() -> None:
    """240 random int strategies over 8 ops on 4 and 8 devices: every suggestion of every
    refusal plans, and at most 4 are listed."""
    listed = 0
    bad = []
    for (cls, shapes), strategy, n in sweep():
        message = refusal(cls, shapes, strategy, n)
        if message is None or "valid: " not in message:
            continue
        fixes = suggested(message)
        assert len(fixes) <= 4, message
        listed += len(fixes)
        for fix in fixes:
            refused = refusal(cls, shapes, fix, n)
            if refused is not None:
                bad.append(f"{cls.__name__} {strategy} on {n}: {fix} refused: {refused}")
    assert not bad, "\n".join(bad[:5]) + f"\n({len(bad)} of {listed})"
    assert listed > 100  # (the sweep reaches the suggestions)


def plans_all(cls: type, shapes: list[tuple[int, ...]], strategy: Any, n: int) -> list[Any]:
    message = refusal(cls, shapes, strategy, n)
    assert message is not None
    fixes = suggested(message)
    for fix in fixes:
        assert refusal(cls, shapes, fix, n) is None, (fix, message)
    return fixes


def test_two_mismatched_dims_next_to_a_class_dim() -> None:
    """((2, 2), (1, 1)) listed ((2, 2), (2, 2)) and ((1, 2), (1, 2)), which split the class
    dim; the split now moves onto the batch, or is dropped."""
    fixes = plans_all(SoftmaxCrossEntropyWithLogits, [(8, 16), (8, 16)], ((2, 2), (1, 1)), 4)
    assert fixes == [((4, 1), (4, 1)), ((2, 1), (2, 1)), ((1, 1), (1, 1))]


def test_a_tie_fix_does_not_split_a_normalized_dim() -> None:
    fixes = plans_all(LayerNorm, [(8, 16), (16,), (16,)], ((1, 4), (4,), (2,)), 4)
    assert fixes == [((4, 1), (1,), (1,)), ((2, 1), (1,), (1,))]


def test_a_split_broadcast_dim_before_a_mismatch() -> None:
    """The broadcast dim came first and its fix ((2, 1), (1, 2)) left dim 0 split 2 and 1; the
    message now names both and each fix repairs both."""
    message = refusal(Add, [(8, 1), (8, 8)], ((2, 2), (1, 2)), 4)
    assert message is not None
    assert "input 0 (x) dim 0 and input 1 (y) dim 0 must be split alike" in message, message
    assert "input 0 (x) dim 1 (size 1) is broadcast but split" in message, message
    fixes = plans_all(Add, [(8, 1), (8, 8)], ((2, 2), (1, 2)), 4)
    assert fixes == [((2, 1), (2, 2)), ((1, 1), (1, 2))]


@pytest.mark.parametrize(
    ("cls", "shapes", "strategy", "words"),
    [
        # ((4, 1), (4, 2)) uses 8 devices of 4
        (Add, [(8, 1), (8, 8)], ((4, 2), (4, 2)), "valid: 1 for each broadcast dim, with"),
        # ((8, 1),) uses 8 devices of 4
        (Softmax, [(8, 8)], ((8, 8),), "valid: 1 for that dim, with the other splits"),
    ],
)
def test_a_fix_that_does_not_fit_the_device_count_is_said_in_words(
    cls: type, shapes: list[tuple[int, ...]], strategy: Any, words: str
) -> None:
    message = refusal(cls, shapes, strategy, 4)
    assert message is not None
    assert words in message and "dividing the device count 4" in message, message
    assert suggested(message) == [], message


LAYOUT = sw.Layout((2, 2, 2), ("dp", "sp", "mp"))


def layout_fixes(message: str) -> list[Any]:
    """The Layout strategies the message lists after ``valid:`` (none where it says what to
    change in words), as the user would write them with `LAYOUT`."""
    listed = message.split("valid: ")[1]
    if not listed.startswith("(layout("):
        return []
    return [eval(s, {"layout": LAYOUT}) for s in listed.split(" or ")]


def random_layout(rng: random.Random, ndim: int) -> Any:
    free = ["dp", "sp", "mp"]
    args: list[Any] = []
    for _ in range(ndim):
        axes = [a for a in free if rng.random() < 0.4]
        rng.shuffle(axes)
        free = [a for a in free if a not in axes]
        args.append(tuple(axes) if axes else "None")
    return LAYOUT(*args)


def test_every_suggested_layout_strategy_plans_and_repairs_every_dim() -> None:
    """A Layout strategy with two dims split differently: the fix named only the first
    (``the same axes ... as input 0 (x) dim 0``), following it left dim 1 wrong; the message
    now lists Layout strategies that repair both."""
    message = refusal(Add, [(8, 8), (8, 8)], (LAYOUT("dp", "mp"), LAYOUT("mp", "dp")), 8)
    assert message is not None
    assert "input 0 (x) dim 1 and input 1 (y) dim 1 into 2 (axes mp) and 2 (axes dp)" in message
    assert layout_fixes(message) == [
        (LAYOUT("dp", "mp"), LAYOUT("dp", "mp")),
        (LAYOUT("mp", "dp"), LAYOUT("mp", "dp")),
    ]
    # a sweep: every listed fix plans, over ops with ties, broadcast dims and a contracted dim
    rng = random.Random(7)
    cases = [(Add, [(8, 8), (8, 8)]), (Add, [(8, 1), (8, 8)]), (MatMul, [(8, 8), (8, 8)])]
    cases += [(BatchMatMul, [(4, 8, 8), (4, 8, 8)])]
    listed, bad = 0, []
    for cls, shapes in cases:
        for _ in range(40):
            strategy = tuple(random_layout(rng, len(s)) for s in shapes)
            message = refusal(cls, shapes, strategy, 8)
            if message is None or "must be split alike" not in message:
                continue
            for fix in layout_fixes(message):
                listed += 1
                if refusal(cls, shapes, fix, 8) is not None:
                    bad.append(f"{cls.__name__} {strategy}: {fix} refused")
    assert not bad, "\n".join(bad[:5])
    assert listed > 30
