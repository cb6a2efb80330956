"""``F.scaled_dot_product_attention`` with dropout: planned as its math form, masks as one device.

With ``dropout_p > 0`` the attention kernel draws its dropout mask itself; run on each rank's
block, every rank would draw its own mask of its block's shape, and no mask would be the
single-device one. On CPU, one device computes such a call by torch's math form (scores,
softmax, dropout of the attention weights, product with v), and a capture records exactly that
program (``bmm``, ``_safe_softmax``, ``bernoulli_``, ...), which the planner follows with the
sharding rules like any other op. `attention_dropout` tells the planner to mark such a node
(`NodePlan.local` = `ATTENTION_DROPOUT`): the executor then computes the same math form on this
rank's blocks and multiplies the attention weights by this rank's block of one mask of the
*global* weights' shape, drawn as one device draws it (`parallel/_local.attention_dropout`), so
the output and its gradients equal one device's.
"""

from __future__ import annotations

from shardwise.planner._graph import Node

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
