"""Sharding rules of whole torch-level ops, for ops whose aten program no rule can follow.

The planner plans a torch-level op by running its aten program on placements
(`planner._follow`, the rules of `aten_rules`). Some ops are parallel over a dim as a whole
while their program is not, op by op: a recurrent layer (``torch.lstm``, ``torch.gru``,
``torch.rnn_tanh``, ``torch.rnn_relu``, what ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` call) runs
each sample of the batch on its own, but its CPU program folds time and batch into one dim for
the input projections, so followed op by op it could only run whole on every rank. Others need
a refusal with the fix where the module around the op would fail on this rank's block
(``nn.InstanceNorm``'s channel check).

`NODE_RULES` maps such an op's qualified name (as the capture records it) to a rule ``rule(have,
shapes, args, kwargs, ndim, given)``: the placements each tensor input has (one per mesh dim,
DTensor's ``Shard`` / ``Replicate``), their global shapes, the call's captured positional and
keyword arguments (tensors as `planner._graph.TensorSlot`), the mesh's dims and, per tensor
input, whether it is
a call input each rank passes its own block of (the ``"data_parallel"`` convention: not one cut
from a whole one); it returns ``(need, outs)``, the placements
the inputs must have and those of the outputs, or None to follow the aten program as usual; a
ValueError says the op cannot run as placed (the planner raises it as a `PlanError` naming the
op). Adding an op is one entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.tensor import Placement, Replicate, Shard

from shardwise._torch.dtensor import StridedShard

Placements = tuple[Placement, ...]
NodeRule = Callable[
    [
        Sequence[Placements],
        Sequence[tuple[int, ...]],
        Sequence[Any],
        Mapping[str, Any],
        int,
        Sequence[bool],
    ],
    tuple[list[Placements], list[Placements]] | None,
]


def recurrent_rule(states: int, outputs: int) -> NodeRule:
    """``torch.lstm`` (`states` 2: h and c) / ``torch.gru``, ``torch.rnn_*`` (1), called as
    ``(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)``.

    Per mesh dim: an input split on its batch dim (0 with ``batch_first``, else 1) keeps the
    split; the hidden states (``[layers, batch, hidden]``) are split on dim 1 alike, the
    weights whole; the output is split as the input, the final states as the hidden states
    (`outputs`: the op's tensor outputs). An unbatched input or one split on any other dim
    returns None. A dropout between layers while training on a split batch raises ValueError:
    the op draws its masks inside, each rank its own, unlike one device's; so does an input
    split on its features (after a column-parallel layer): ``nn.RNNBase`` checks the input's
    feature size on this rank's block before the op runs.
    """

    def rule(
        have: Sequence[Placements],
        shapes: Sequence[tuple[int, ...]],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        ndim: int,
        given: Sequence[bool],
    ) -> tuple[list[Placements], list[Placements]] | None:
        if len(shapes[0]) != 3 or len(args) < 9:
            return None
        layers, dropout, train, batch_first = args[4], args[5], args[6], args[8]
        batch = 0 if batch_first else 1
        if any(type(p) is Shard and p.dim == 2 for p in have[0]):
            raise ValueError(
                "its input arrives split on its features (the layer before it is column "
                "parallel), and the recurrent module checks the feature size on this rank's "
                "block before the op runs; make the features whole before the module "
                "(x = sw.reshard(x, (dp, 1, 1)) with dp the split of the rows), or make the "
                "layer before it row parallel (or leave it unannotated)"
            )
        keep = [type(p) is Shard and p.dim == batch for p in have[0]]
        if not any(keep):
            return None
        if train and dropout and layers > 1:
            raise ValueError(
                f"its dropout={dropout} between layers draws masks inside the op, each rank its "
                f"own for its rows, unlike one device's; set dropout=0 and put nn.Dropout "
                f"between single-layer recurrent modules (or call model.eval())"
            )
        x: Placements = tuple(Shard(batch) if k else Replicate() for k in keep)
        h: Placements = tuple(Shard(1) if k else Replicate() for k in keep)
        whole: Placements = tuple(Replicate() for _ in range(ndim))
        need = [x] + [h] * states + [whole] * (len(have) - 1 - states)
        return need, [x] + [h] * (outputs - 1)

    rule.__name__ = f"recurrent_rule_{states}"
    return rule


def embedding_bag_rule(
    have: Sequence[Placements],
    shapes: Sequence[tuple[int, ...]],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    ndim: int,
    given: Sequence[bool],
) -> tuple[list[Placements], list[Placements]] | None:
    """``F.embedding_bag(input, weight, offsets=None, ..., per_sample_weights=None)`` (what
    ``nn.EmbeddingBag`` calls; tensors after the weight come by keyword, in that order).

    - A 2-D input (one bag per row) split on its rows only keeps them: each rank reduces its
      own bags (``per_sample_weights`` split alike, the weight whole), the output ``[bags,
      dim]`` split on its rows alike (DTensor has no rule: the input was gathered and every rank
      computed every bag). Not with ``max_norm``: the op then rescales in place the weight rows
      its input reads, which must be the whole batch's on every rank.
    - A 1-D input with offsets (its third tensor) that each rank passes its own part of
      (`given`): ValueError. Each rank's offsets index its own flat input, which the
      data-parallel convention cannot join into one global input (the joined offsets restart
      at 0: silently other bags than one device's).
    - Otherwise (whole inputs cut at entry under ``"full_batch"``, other splits): None, the aten
      program as usual.
    """
    if len(shapes[0]) == 1:
        if len(have) >= 3 and (given[0] or given[2]):
            raise ValueError(
                "a 1-D input with offsets arrives as each rank's own bags (their offsets from "
                "0), which cannot be joined into one global batch; pass a 2-D input (bags of one "
                'length, padding_idx for the shorter ones) or use dataset_strategy("full_batch") '
                "with the whole batch's input and offsets"
            )
        return None
    rows = have[0]
    if len(shapes[0]) != 2 or not all(type(p) is Replicate or p == Shard(0) for p in rows):
        return None
    max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
    if max_norm is not None:
        return None
    if not any(type(p) is Shard for p in rows):
        return None
    whole: Placements = tuple(Replicate() for _ in range(ndim))
    need = [rows, whole, *[rows] * (len(have) - 2)]  # (per_sample_weights: as the input)
    return need, [rows]


def embedding_rule(
    have: Sequence[Placements],
    shapes: Sequence[tuple[int, ...]],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    ndim: int,
    given: Sequence[bool],
) -> tuple[list[Placements], list[Placements]] | None:
    """``F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq,
    sparse)`` (what ``nn.Embedding`` calls): with ``scale_grad_by_freq`` and the ids split,
    the ids and the weight whole and the output whole (each row's gradient is divided by how
    often its id occurs in the whole batch: each rank counting its own ids made it n times
    one device's). With ``max_norm`` and the weight's embedding dim (dim 1) split: ValueError
    (the op rescales in place each row it reads by the row's norm over the whole embedding dim;
    each rank would take its block's norm). Otherwise None, DTensor's rule as usual."""
    max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
    if max_norm is not None and len(have) > 1 and any(_splits(p, 1) for p in have[1]):
        raise ValueError(
            f"nn.Embedding(max_norm={max_norm}) rescales in place every row it looks up by the "
            "row's norm over the whole embedding dim, which this annotation splits over the "
            "ranks (each would take its own block's norm); leave the embedding dim whole (no "
            "annotation on this embedding), or drop max_norm and renormalize the weight's rows "
            "yourself (torch.renorm under torch.no_grad() before the step)"
        )
    scaled = kwargs.get("scale_grad_by_freq", args[5] if len(args) > 5 else False)
    if not scaled or not any(isinstance(p, Shard | StridedShard) for p in have[0]):
        return None
    whole: Placements = tuple(Replicate() for _ in range(ndim))
    return [whole] * len(have), [whole]


def _splits(p: Placement, dim: int) -> bool:
    """Whether placement `p` splits `dim` (plainly, or strided: a channel shuffle's groups)."""
    return isinstance(p, Shard | StridedShard) and p.dim == dim


def instance_norm_rule(
    have: Sequence[Placements],
    shapes: Sequence[tuple[int, ...]],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    ndim: int,
    given: Sequence[bool],
) -> tuple[list[Placements], list[Placements]] | None:
    """``F.instance_norm(input, running_mean, running_var, weight, bias, ...)`` (what
    ``nn.InstanceNorm1d/2d/3d`` call): an input split on its channels (dim 1, also strided)
    raises ValueError,
    since the module checks the channel count on this rank's block before the op runs (its
    own ValueError from inside torch); otherwise None, the aten program as usual."""
    if len(shapes[0]) < 2 or not any(_splits(p, 1) for p in have[0]):
        return None
    raise ValueError(
        "its input arrives split on its channels (dim 1), and nn.InstanceNorm checks the "
        "channel count on this rank's block before the op runs; make the channels whole "
        "before the module (x = sw.reshard(x, (dp, 1, 1)) with dp the split of the rows), or "
        "leave the layer that splits them unannotated"
    )


NODE_RULES: dict[str, NodeRule] = {
    "torch.nn.functional.instance_norm": instance_norm_rule,
    "torch.nn.functional.embedding_bag": embedding_bag_rule,
    "torch.nn.functional.embedding": embedding_rule,
    "torch.lstm": recurrent_rule(2, 3),
    "torch.gru": recurrent_rule(1, 2),
    "torch.rnn_tanh": recurrent_rule(1, 2),
    "torch.rnn_relu": recurrent_rule(1, 2),
}
"""Torch-level op name -> its rule (see the module docstring)."""
