"""Random draws inside torch ops: which ones the plan runs with one device's draws.

``F.scaled_dot_product_attention`` with dropout: planned as its math form, masks as one device.

With ``dropout_p > 0`` the attention kernel draws its dropout mask itself; run on each rank's
block, every rank would draw its own mask of its block's shape, and no mask would be the
single-device one. On CPU, one device computes such a call by torch's math form (scores,
softmax, dropout of the attention weights, product with v), and a capture records exactly that
program (``bmm``, ``_safe_softmax``, ``bernoulli_``, ...), which the planner follows with the
sharding rules like any other op. `attention_dropout` tells the planner to mark such a node
(`NodePlan.local` = `ATTENTION_DROPOUT`): the executor then computes the same math form on this
rank's blocks and multiplies the attention weights by this rank's block of one mask of the
*global* weights' shape, drawn as one device draws it (`parallel/_local.attention_dropout`), so
the output and its gradients equal one device's. ``F.dropout`` (``nn.Dropout``) is drawn the
same way (`parallel/_local.dropout_block`).

`check_random_draws` refuses any other op that draws random numbers inside (an aten op tagged
``nondeterministic_seeded``: ``F.multi_head_attention_forward``'s attention dropout,
``F.dropout2d``, ``F.rrelu`` in training, ...) on a split input: each rank would draw for its
own block, and no rank's numbers would be one device's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Placement, Replicate

from shardwise._torch.dispatch import argument_names
from shardwise.planner._graph import AtenCall, Node
from shardwise.planner._placement import PlanError

ATTENTION_DROPOUT = "attention_dropout"
"""`NodePlan.local` of a scaled-dot-product attention with a dropout probability > 0."""

SDPA = "torch.nn.functional.scaled_dot_product_attention"
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""``F.scaled_dot_product_attention``'s parameters in order (`parallel/_local` reads them)."""


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


DROPOUT = "torch.nn.functional.dropout"


def check_random_draws(node: Node, need: Sequence[Sequence[Placement]]) -> None:
    """Refuse `node` when it draws random numbers inside on an input split as `need` (its
    inputs' placements per mesh dim) and the plan cannot draw them as one device does.

    Raises:
        PlanError: naming the op, where it is called, its random aten op and the fix.
    """
    if node.op in (DROPOUT, SDPA):  # (drawn as one device draws: see the module docstring)
        return
    if all(isinstance(p, Replicate) for placements in need for p in placements):
        return  # (whole inputs: every rank draws the whole, as one device)
    seeded = next((c.op for c in node.aten if _draws(c)), None)
    if seeded is None:
        return
    raise PlanError(
        f"{node.name} ({node.op} at {node.source}): it draws random numbers inside ({seeded}) "
        f"on its inputs split across ranks, so each rank would draw for its own block and the "
        f"numbers would not be one device's; draw them with F.dropout / nn.Dropout or "
        f"F.scaled_dot_product_attention(dropout_p=...) (their masks are drawn as one device "
        f"draws them), or set this op's dropout to 0 (nn.MultiheadAttention(dropout=0.0))"
    )


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
