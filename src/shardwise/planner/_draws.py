"""Random draws inside torch ops: planned so that each rank draws its block of one device's draw.

A torch op that draws random numbers (dropout masks) on a split input would, run on each rank's
block, draw for that block alone: no rank's numbers would be one device's. The plan makes them
one device's three ways:

- ``F.dropout`` (``nn.Dropout``): the executor multiplies by this rank's block of one mask of
  the global shape (`parallel/_local.dropout_block`).
- ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (`attention_dropout`): on CPU one
  device computes it by torch's math form (scores, softmax, dropout of the attention weights,
  product with v), the program a capture records and the planner follows; the node is marked
  (`NodePlan.local` = `ATTENTION_DROPOUT`) and the executor computes that form on this rank's
  blocks with this rank's block of one mask of the global weights' shape
  (`parallel/_local.attention_dropout`).
- any other op whose aten program fills a tensor in place with random numbers (``bernoulli_``,
  ``uniform_``, ``normal_`` ...: ``F.multi_head_attention_forward``'s attention dropout,
  ``F.alpha_dropout``, ``F.dropout2d``) on split inputs (`plan_draws`): the planner records, for
  each such call in order, the placement, global shape and memory order of the tensor it fills
  (`NodePlan.draws`, local = `GLOBAL_DRAWS`), and the executor lets each fill the whole tensor
  as one device fills it (in one device's memory order: a fill runs in memory order) and keeps
  this rank's block (`parallel/_global_draws.GlobalDraws`). ``F.dropout`` and SDPA list their fills
  too, for the memory order of their masks.

- a random tensor shaped like another (``torch.randn_like(std)``, a VAE's noise;
  ``rand_like``, ``randint_like``) is planned the same way (its output's placement, global
  shape and memory order): the executor draws the whole as one device does and keeps this
  rank's block.

A draw that makes a new tensor from the values of others (``bernoulli(p)``,
``native_dropout``, a fused attention kernel with dropout) on split inputs is refused with a
`PlanError` naming the op, its random aten op and the fix. On whole inputs every rank draws
the whole, as one device does. An op of `MAY_DRAW` planned without draws (an ``eval()`` call)
is watched on split inputs, and a draw plans the call again
(`parallel/_global_draws.UnplannedDraw`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate

from shardwise._torch.dispatch import argument_names
from shardwise.planner._graph import AtenCall, Node
from shardwise.planner._placement import PlanError

Placements = tuple[Placement, ...]
Shape = tuple[int, ...]
Draw = tuple[Placements, Shape, tuple[int, ...]]
"""A random fill: the filled tensor's placements, global shape and memory order (its dims
from the largest stride to the smallest, as one device lays it out)."""

ATTENTION_DROPOUT = "attention_dropout"
"""`NodePlan.local` of a scaled-dot-product attention with a dropout probability > 0."""

GLOBAL_DRAWS = "global_draws"
"""`NodePlan.local` of an op whose in-place random fills each draw the whole (`NodePlan.draws`)."""

SDPA = "torch.nn.functional.scaled_dot_product_attention"
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""``F.scaled_dot_product_attention``'s parameters in order (`parallel/_local` reads them)."""

DROPOUT = "torch.nn.functional.dropout"

MAY_DRAW = frozenset(
    f"torch.nn.functional.{name}"
    for name in (
        "multi_head_attention_forward",
        "alpha_dropout",
        "feature_alpha_dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "rrelu",
    )
)
"""Torch functions that draw in training only or with a nonzero drop probability: planned
without draws (an ``eval()`` call), the executor watches them for draws (and plans again)."""


def attention_dropout(node: Node) -> bool:
    """Whether `node` is a scaled-dot-product attention that drops attention weights.

    Example:
        >>> attention_dropout(node)  # F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        True
    """
    if node.op != SDPA:
        return False
    at = SDPA_ARGS.index("dropout_p")
    p = node.kwargs.get("dropout_p", node.args[at] if len(node.args) > at else 0.0)
    return bool(p)


Follow = Callable[[Node, list[Placements], list[tuple[AtenCall, Placements]]], Any]
"""Runs a node's aten program on placements, appending each call with its first output's."""


def plan_draws(node: Node, need: Sequence[Placements], follow: Follow) -> tuple[Draw, ...]:
    """The in-place random fills of `node`, run on inputs placed `need`: for each, in order,
    the placements, global shape and memory order (`Draw`) of the tensor it fills; empty when
    the node draws nothing or runs on whole inputs. (``F.dropout`` and SDPA, which the executor
    draws itself, list theirs for the memory order only.)

    Raises:
        PlanError: a draw that is no in-place fill (or fills a partial value), on split
            inputs: naming the op, where it is called, its random aten op and the fix.

    Example:
        >>> plan_draws(node, need, follow)  # F.alpha_dropout on rows split over g0
        (((Shard(dim=0),), (8, 3, 8), (0, 1, 2)),)
    """
    if not any(_draws(c) for c in node.aten):
        return ()
    if all(isinstance(p, Replicate) for placements in need for p in placements):
        return ()  # (whole inputs: every rank draws the whole, as one device)
    seen: list[tuple[AtenCall, Placements]] = []
    follow(node, list(need), seen)
    own = node.op in (DROPOUT, SDPA)  # (drawn by the executor: in-place fills listed only)
    out = []
    for call, placements in seen:
        if not _draws(call):
            continue
        fills = (_fills_in_place(call) or is_like_draw(call.op)) and not any(
            isinstance(p, Partial) for p in placements
        )
        if not fills and not own:
            raise PlanError(
                f"{node.name} ({node.op} at {node.source}): it draws random numbers inside "
                f"({call.op}) on its inputs split across ranks, so each rank would draw for its "
                f"own block and the numbers would not be one device's; draw them with "
                f"F.dropout / nn.Dropout or F.scaled_dot_product_attention(dropout_p=...) (their "
                f"masks are drawn as one device draws them), or set this op's dropout to 0"
            )
        if fills:
            filled = call.outputs[0]
            order = tuple(sorted(range(len(filled.stride)), key=lambda d: -filled.stride[d]))
            out.append((placements, tuple(filled.info.shape), order))
    return tuple(out)


def is_fill(func: Any) -> bool:
    """Whether an aten op fills its first argument with random numbers in place
    (``bernoulli_``, ``uniform_``, ``normal_`` ...)."""
    return torch.Tag.nondeterministic_seeded in func.tags and str(
        func.overloadpacket.__name__
    ).endswith("_")


def is_like_draw(func: Any) -> bool:
    """Whether an aten op draws a new random tensor shaped like its first argument, from its
    shape, dtype and layout only (``randn_like``, ``rand_like``, ``randint_like``)."""
    return torch.Tag.nondeterministic_seeded in func.tags and str(
        func.overloadpacket.__name__
    ).endswith("_like")


def _fills_in_place(call: AtenCall) -> bool:
    return is_fill(call.op) and len(call.outputs) == 1


def _draws(call: AtenCall) -> bool:
    """Whether an aten call draws random numbers: a seeded op, unless its ``dropout_p`` is 0
    (an attention kernel without dropout)."""
    if torch.Tag.nondeterministic_seeded not in call.op.tags:
        return False
    names = argument_names(call.op)
    if "dropout_p" not in names:
        return True
    bound = dict(zip(names, call.args, strict=False)) | dict(call.kwargs)
    return bool(bound.get("dropout_p", 0.0))
