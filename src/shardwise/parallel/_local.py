"""Local compute that is more than "run the primitive on the local blocks" (`OpPlan.local`).

- ``"masked_lookup"`` (`masked_lookup`): Gather with its params split on the gathered axis. Each
  rank holds the rows ``[lo, lo + n)``; indices outside them are looked up at row 0 of the block
  and their results zeroed (`Masked.apply`), so the plan's AllReduce over the split axes sums
  exactly one non-zero contribution per index, the single-device value. Their gradients are
  zero, so each rank's block only receives the gradient of the rows it holds.
- ``"random"`` (`dropout_noise`): Dropout draws one uniform noise tensor of the *global* shape
  (`communication.replicated_draw`: the same value on every rank, the generator advanced as in
  a single-device run) and gives the primitive this rank's block of it, so the mask is the
  same slice of the single-device mask.

- ``"batch_stats"`` (`batch_stats_gather`): BatchNorm in training with its input split on N, H
  or W. Each rank computes its block's per-channel mean and sum of squared deviations; one
  AllGather over the axes splitting N / H / W (as its node's plan lists it: `stats_axes`)
  collects them (autograd-aware: its adjoint is a ReduceScatter) and the primitive combines
  them into the statistics of the whole batch (`shardwise.ops._nn_primitives.batch_stats`), so
  y, the gradients and the running statistics equal one device's.

`prepare` dispatches on the tag and returns the new local inputs and what to do to the outputs.

- ``F.dropout`` in a captured network (`dropout_block`, for the plan executor): the same, a
  mask of the global shape drawn as one device draws it, this rank's block of it applied.
- A cross entropy / NLL mean over split rows (`loss_weight`, for the plan executor): the
  targets this rank counted, by which the loss's AllReduce divides the ranks' summed losses;
  each rank runs the loss as a sum (`summed_loss`), so a rank that counted nothing adds 0 and
  backward never divides by its count of 0 (a float16 loss summed in float32: `float_sum`).
- A training ``F.batch_norm`` on split rows (`batch_norm_split`, for the plan executor): the
  same computation as the ``"batch_stats"`` primitive (`ops._nn_primitives.batch_norm_training`),
  so each rank normalizes its rows as one device.
- ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (`attention_dropout`, for the plan
  executor): torch's math form on this rank's blocks, the attention weights dropped by this
  rank's block of one global mask (as one device's math form draws it).
- Any other op with random in-place fills (``_global_draws.GlobalDraws``, for the plan
  executor: the node's `NodePlan.draws`): each fill draws the whole tensor as one device does
  and keeps this rank's block.

`compute` is the plan executor's one entry: node k's op on this rank's blocks, by the plan
(`drop` for a dropout or an attention, on the executor's short path too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardwise import communication as comm
from shardwise.layout import TensorLayout
from shardwise.ops import BatchNorm, Dropout, Primitive
from shardwise.ops._nn_primitives import batch_norm_training
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._global_draws import GlobalDraws, empty_as
from shardwise.parallel._node_table import NodeTable, resized_call
from shardwise.parallel._runtime import group_for
from shardwise.planner import NodePlan
from shardwise.planner._batch_norm import BN_ARGS
from shardwise.planner._draws import SDPA_ARGS
from shardwise.planner._losses import KL_ARGS, KL_DIV, LOSS_ARGS
from shardwise.planner._placed import Collective
from shardwise.redistribution import block_offset, local_block

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Masked:
    """Zero the results of the indices this rank does not hold (output 0 of Gather)."""

    mask: torch.Tensor  # the indices' shape, True where this rank holds the row
    view: tuple[int, ...]  # `mask` reshaped to broadcast against the output

    def apply(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        out = outputs[0]
        outputs[0] = out * self.mask.reshape(self.view).to(out.dtype)
        return outputs


def masked_lookup(
    args: Sequence[Any],
    layouts: Sequence[TensorLayout],
    shapes: Sequence[Shape],
    axis: int,
    b: int,
    who: str = "Gather",
) -> tuple[list[Any], Masked]:
    """Gather's local inputs when the params are split on `axis` (see the module docstring).

    Args:
        args: this rank's params block and indices block (whole, or split on dim 0 only:
            `shardwise.ops.rules.batch_and_rows`).
        layouts: the params' and indices' layouts.
        shapes: their global shapes.
        axis: the gathered axis of the params (normalized).
        b: batch_dims.
        who: the primitive, for the error.

    Returns:
        The local inputs (indices shifted into the block, out-of-block ones set to 0) and the
        output fix-up.

    Raises:
        IndexError: an index outside the params' global rows (one device raises too).
    """
    params, indices = args[0], args[1]
    total = shapes[0][axis]
    if bool(((indices < 0) | (indices >= total)).any()):  # (one device's lookup raises too)
        raise IndexError(
            f"{who}: an index is out of range for the params' dim {axis} of size {total} "
            f"(below 0 or from {total} on); each rank looks up only its block of the rows, so "
            "such an index would give a zero row where one device raises"
        )
    lo = block_offset(layouts[0], axis, shapes[0])
    rows = int(params.shape[axis])
    shifted = indices - lo
    mask = (shifted >= 0) & (shifted < rows)
    local_idx = torch.where(mask, shifted, torch.zeros_like(shifted))
    idx, p = tuple(indices.shape), len(shapes[0])  # (the local block's shape)
    view = (*idx[:b], *(1,) * (axis - b), *idx[b:], *(1,) * (p - axis - 1))
    return [params, local_idx, *args[2:]], Masked(mask, tuple(int(v) for v in view))


def dropout_noise(module: Dropout, layout: TensorLayout, shape: Shape, x: torch.Tensor) -> None:
    """Give `module` this rank's block of one global noise draw for its next forward."""
    keep = float(module.init_args()["keep_prob"])
    if not module.training or keep == 1.0:
        return  # the forward draws nothing
    gen = module.generator(x.device)

    def draw() -> torch.Tensor:
        return torch.rand(shape, dtype=x.dtype, device=x.device, generator=gen)

    with torch.no_grad():
        noise = comm.replicated_draw(draw)
        module.set_next_noise(local_block(noise, layout, shape))


def stats_axes(comms: Sequence[Collective], layout: TensorLayout) -> list[int] | None:
    """The axes (of `layout`'s device matrix) of a batch norm's statistics AllGather as its
    node's plan lists it (`comms`: the node's collectives, the one with a `Collective.block`);
    None when the plan lists none (the rows are whole on this node)."""
    for c in comms:
        if c.block > 0 and c.kind == "AllGather":
            return [layout.matrix.names.index(a) for a in c.axes]
    return None


def batch_stats_gather(
    module: BatchNorm, layout: TensorLayout, comms: Sequence[Collective]
) -> None:
    """Give `module` the AllGather of its next forward's block statistics as its node's plan
    lists it (`comms`: `stats_axes`), nothing when it lists none."""
    axes = stats_axes(comms, layout)
    if axes is not None:
        group, _ = group_for(layout.matrix, axes)
        module.set_next_gather(comm.AllGather(group))


def prepare(
    module: Primitive,
    tag: str,
    local: list[Any],
    layouts: Sequence[TensorLayout],
    shapes: Sequence[Shape],
    call_args: dict[str, Any],
    comms: Sequence[Collective] = (),
) -> tuple[list[Any], Masked | None]:
    """Apply `OpPlan.local` tag `tag` before `module` runs on `local` (its local inputs;
    `comms`: its node's collectives, which a batch norm's statistics gather is read from).

    Returns:
        The local inputs to run with, and the output fix-up (None: none).

    Raises:
        UnsupportedParallelError: an unknown tag.
    """
    if not tag:
        return local, None
    if tag == "masked_lookup":
        axis = int(call_args["axis"]) % len(shapes[0])
        b = int(module.init_args()["batch_dims"])
        return masked_lookup(local, layouts, shapes, axis, b, module.who)
    if tag == "batch_stats" and isinstance(module, BatchNorm):
        batch_stats_gather(module, layouts[0], comms)
        return local, None
    if tag == "random" and isinstance(module, Dropout):
        dropout_noise(module, layouts[0], shapes[0], local[0])
        return local, None
    raise UnsupportedParallelError(f"{module.who}: local mode {tag!r} is not supported")


def _by_name(names: Sequence[str], args: Sequence[Any], kw: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by name (`names`: its parameters in order; defaults left out)."""
    return dict(zip(names, args, strict=False)) | kw


def _dropout_args(args: Sequence[Any], kw: dict[str, Any]) -> dict[str, Any]:
    """An ``F.dropout(*args, **kw)`` call's arguments by name."""
    return _by_name(("input", "p", "training", "inplace"), args, kw)


def dropout_p(args: Sequence[Any], kw: dict[str, Any]) -> float:
    """The drop probability of an ``F.dropout(*args, **kw)`` call (0: the identity, in
    training and evaluation alike)."""
    return float(_dropout_args(args, kw).get("p", 0.5))


def dropout_block(
    layout: TensorLayout,
    shape: Shape,
    args: Sequence[Any],
    kw: dict[str, Any],
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """``F.dropout(*args, **kw)`` on this rank's block (of `layout`) of an output of global
    `shape`: this rank's block of one global mask (as one device draws it, laid out in memory
    in `order`: `empty_as`)."""
    bound = _dropout_args(args, kw)
    x, p = bound["input"], dropout_p(args, kw)
    if not bound.get("training", True) or p == 0:
        return x  # type: ignore[no-any-return]
    ones = empty_as(x, shape, order)
    mask = comm.replicated_draw(lambda: F.dropout(ones().fill_(1), p, True))
    mask = local_block(mask, layout, shape)
    return x.mul_(mask) if bound.get("inplace", False) else x * mask  # type: ignore[no-any-return]


def loss_weight(op: str, args: Sequence[Any], kw: dict[str, Any]) -> torch.Tensor:
    """What an ``F.cross_entropy`` / ``F.nll_loss(*args, **kw)`` mean divides by on this rank
    (`planner.WEIGHTED_MEAN`): the targets not equal to ``ignore_index``, each counted with its
    class's ``weight``; for ``F.kl_div``'s batchmean and a cross entropy of class probabilities
    (`op`), the rows torch divides by (float32, no gradient)."""
    if op == KL_DIV:
        x = _by_name(KL_ARGS, args, kw)["input"]
        return torch.tensor(float(x.shape[0]) if x.dim() else 1.0, device=x.device)
    bound = _by_name(LOSS_ARGS, args, kw)
    target: torch.Tensor = bound["target"]
    if target.is_floating_point():  # (class probabilities: a mean over the rows)
        x = bound["input"]
        rows = x.numel() // x.shape[1] if x.dim() > 1 else 1
        return torch.tensor(float(rows), device=x.device)
    weight: torch.Tensor | None = bound.get("weight")
    kept = target != bound.get("ignore_index", -100)
    if weight is None:
        counted: torch.Tensor = kept.sum(dtype=torch.float32)
        return counted
    per_target = weight.detach().float()[target.masked_fill(~kept, 0)]
    weighted: torch.Tensor = (per_target * kept).sum()
    return weighted


def summed_loss(
    op: str, args: Sequence[Any], kw: dict[str, Any]
) -> tuple[Any, dict[str, Any], bool]:
    """The arguments of a mean loss `op` (``F.cross_entropy`` / ``F.nll_loss`` /
    ``F.kl_div``'s batchmean: `planner.WEIGHTED_MEAN`) with ``reduction="sum"``: this rank's
    loss times what its mean divides by (`loss_weight`), without that division. A rank whose
    targets all count 0 (ignored, or of classes of weight 0) gets 0 and zero gradients, where
    its mean (0 / 0) and that mean's backward (weight x gradient / 0) are NaN.

    A float16 input's sum could overflow float16 (65504: 8,192 tokens of loss 8) where its
    mean does not: it runs with ``reduction="none"`` instead (the third value True), each
    element's loss in float16's range, and `float_sum` sums them in float32 (under autocast
    the elements are float32 already)."""
    names = KL_ARGS if op == KL_DIV else LOSS_ARGS
    at = names.index("reduction")
    wide = _by_name(names, args, kw)["input"].dtype == torch.float16
    reduction = "none" if wide else "sum"
    if len(args) > at:
        return (*args[:at], reduction, *args[at + 1 :]), kw, wide
    return tuple(args), {**kw, "reduction": reduction}, wide


def float_sum(out: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    """The elements' losses of a loss run by `summed_loss` with ``reduction="none"`` summed in
    float32 at least, and the dtype to cast the divided mean back to: float16 where torch's
    loss was float16 (None where it was float32: under autocast)."""
    kind = torch.promote_types(out.dtype, torch.float32)
    return out.to(kind).sum(), (out.dtype if out.dtype != kind else None)


def batch_norm_split(args: Sequence[Any], kw: dict[str, Any], node: NodePlan) -> torch.Tensor:
    """A training ``F.batch_norm(*args, **kw)`` on this rank's rows (node `node`, its rows split:
    `planner.SPLIT_BATCH_NORM`), normalized with the whole batch's statistics
    (`ops._nn_primitives.batch_norm_training`, the blocks' statistics gathered as the node's
    plan lists it: `stats_axes`); the running statistics updated as one device does, on
    every rank."""
    layout = node.outputs[0].layout
    axes = stats_axes(node.comms, layout)
    if axes is None:  # (the rows are whole here: torch's own batch norm)
        return F.batch_norm(*args, **kw)
    b = _by_name(BN_ARGS, args, kw)
    group, _ = group_for(layout.matrix, axes)
    y, _, _ = batch_norm_training(
        b["input"], b.get("weight"), b.get("bias"), b.get("running_mean"),
        b.get("running_var"), float(b.get("eps", 1e-5)), float(b.get("momentum", 0.1)),
        comm.AllGather(group),
    )  # fmt: skip
    return y


def attention_p(args: Sequence[Any], kw: dict[str, Any]) -> float:
    """The dropout probability of an ``F.scaled_dot_product_attention(*args, **kw)`` call."""
    return float(_by_name(SDPA_ARGS, args, kw).get("dropout_p", 0.0))


def attention_dropout(
    args: Sequence[Any],
    kw: dict[str, Any],
    layout: TensorLayout,
    shape: Shape,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(*args, **kw)`` with ``dropout_p > 0`` on this rank's
    blocks (`planner.ATTENTION_DROPOUT`; output of global `shape` placed as `layout`): torch's
    math form, scores ``(q·√s)(k·√s)ᵀ`` plus the causal or given mask, softmax, dropout, times v.
    The attention weights ``[..., L, S]`` are split as the output is but on their last dim; the
    dropout multiplies them by this rank's block of one mask of their global shape, drawn as one
    device draws it (`dropout_block`; in memory `order`). ``dropout_p == 0`` runs torch's own
    kernel."""
    p = attention_p(args, kw)
    if p == 0:
        return F.scaled_dot_product_attention(*args, **kw)
    b = _by_name(SDPA_ARGS, args, kw)
    q, k, v, mask = b["query"], b["key"], b["value"], b.get("attn_mask")
    if b.get("enable_gqa", False) and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    scale = b.get("scale")
    root = math.sqrt(scale if scale is not None else 1 / math.sqrt(q.size(-1)))
    scores = (q * root) @ (k * root).transpose(-2, -1)
    groups = (*layout.groups[:-1], 1) if layout.groups else ()
    weights = TensorLayout(layout.matrix, (*layout.dims[:-1], ()), groups)
    weights_shape = (*shape[:-1], k.size(-2))
    if b.get("is_causal", False):  # (this rank's rows of the global causal mask)
        rows = TensorLayout(layout.matrix, (layout.dims[-2], ()), groups[-2:])
        causal = torch.ones(weights_shape[-2:], dtype=torch.bool, device=q.device).tril()
        mask = local_block(causal, rows, weights_shape[-2:])
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
    if mask is not None:
        scores = scores + mask
    if mask is not None and not b.get("is_causal", False):  # (rows masked whole: 0, as torch)
        gone = scores.eq(-math.inf).all(-1, keepdim=True)
        w = scores.masked_fill(gone, 0.0).softmax(-1).masked_fill(gone, 0.0)
    else:
        w = scores.softmax(-1)
    w = dropout_block(weights, weights_shape, (w, p, True), {}, order)
    out: torch.Tensor = w @ v
    return out


def drop(func: Any, node: NodePlan, args: Sequence[Any], kw: dict[str, Any]) -> torch.Tensor:
    """``F.dropout`` (`dropout_block`) or ``F.scaled_dot_product_attention``
    (`attention_dropout`) of node `node` on this rank's blocks, with this rank's block of one
    global mask (laid out in memory as the plan's draw says, when it lists one)."""
    layout, shape = node.outputs[0].layout, node.shapes[0]
    order = node.draws[0][2] if node.draws else None
    if func is F.dropout:
        return dropout_block(layout, shape, args, kw, order)
    return attention_dropout(args, kw, layout, shape, order)


def compute(
    func: Any, k: int, node: NodePlan, table: NodeTable, args: Sequence[Any], kw: dict[str, Any]
) -> Any:
    """Node `k`'s op on this rank's blocks, as its plan (`node`, `table`) says: a view's local
    sizes, a dropout's or an attention's global masks (`drop`), a split batch norm, the
    local sizes of ``unflatten`` / ``new_*`` (`_node_table.resized_call`), its random fills'
    global draws (`GlobalDraws`), or the op itself.

    Raises:
        UnplannedDraw: the op drew a random tensor its plan has no draw for.
    """
    sized = table.sized[k]
    if sized is not None:
        return table.as_sized.get(k, func)(args[0], *sized)
    if func is F.dropout or func is F.scaled_dot_product_attention:
        return drop(func, node, args, kw)
    if k in table.split_norms:
        return batch_norm_split(args, kw, node)
    if k in table.resized:
        args, kw = resized_call(node.op, tuple(args), kw, table.resized[k])
        return func(*args, **kw)
    if k in table.global_draws:
        with GlobalDraws(node.draws, node.name):
            return func(*args, **kw)
    return func(*args, **kw)
