"""What `Model.eval` reads from its dataset: whether it is sharded over the ranks (`sharded`:
a pipeline with ``num_shards > 1``, or a torch ``DataLoader`` over a ``DistributedSampler`` of
several replicas), the wrap-around padding rows at the end of this rank's last batch
(`padding`), and the batches with the count of rows the metrics take from each
(`trimmed_batches`, `rows`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from shardwise._torch import pytree
from shardwise.train._model_checks import columns


def _distributed_sampler(data: object) -> DistributedSampler[Any] | None:
    """A DataLoader's ``DistributedSampler`` (its ``sampler`` or its batch sampler's)."""
    batches = getattr(data, "batch_sampler", None)
    for holder in (getattr(data, "sampler", None), getattr(batches, "sampler", None)):
        if isinstance(holder, DistributedSampler):
            return holder
    return None


def sharded(data: object) -> bool:
    """Whether each rank reads its own rows of `data` (the metrics' counts are then summed)."""
    sampler = _distributed_sampler(data)
    if sampler is not None:
        return int(sampler.num_replicas) > 1
    return (getattr(data, "num_shards", None) or 1) > 1


def padding(data: object) -> int:
    """Rows at the end of this rank's last batch that repeat rows of the epoch: a pipeline's
    wrap-around rows (`get_padding`); a ``DistributedSampler``'s (``drop_last=False`` pads the
    index list to a multiple of the replicas with its first indices, rank r taking positions
    ``r, r + n, ...``: its rows at ``r + i*n >= len(dataset)`` are padding), less those a
    ``drop_last`` batch sampler drops with a short last batch."""
    sampler = _distributed_sampler(data)
    if sampler is None:
        return int(data.get_padding()) if hasattr(data, "get_padding") else 0  # type: ignore[attr-defined]
    if sampler.drop_last:
        return 0
    total = len(sampler.dataset)  # type: ignore[arg-type]
    mine = int(sampler.num_samples)
    pad = mine - len(range(int(sampler.rank), total, int(sampler.num_replicas)))
    batches = getattr(data, "batch_sampler", None)
    size = getattr(batches, "batch_size", None)
    if getattr(batches, "drop_last", False) and isinstance(size, int) and size > 0:
        pad -= mine % size  # (the short last batch, padding rows included, is not yielded)
    return max(pad, 0)


def trimmed_batches(
    data: Iterable[Sequence[torch.Tensor]],
) -> Iterator[tuple[list[torch.Tensor], torch.Tensor, int]]:
    """``(inputs, label, kept)`` per batch: the rows the metrics count are the first `kept`; a
    sharded dataset's last batch leaves out the rows that wrap around to the start of the epoch
    (`get_padding`), so no sample is counted twice (none may be left on some ranks). The network
    runs on the whole batch, so that every rank makes the same calls (collectives included)."""
    pad = padding(data)
    it = iter(data)
    batch = next(it, None)
    while batch is not None:
        following = next(it, None)
        *inputs, label = columns(batch, 2, "eval")
        if isinstance(label, torch.Tensor) and label.dim() == 0:
            raise ValueError(
                "Model.eval: the dataset yields single rows (a label of shape []), and the "
                "metrics count the rows of batches; batch it, e.g. dataset.batch(32) (a "
                "DataLoader batches by itself)"
            )
        kept = len(label) - (pad if following is None else 0)
        yield inputs, label, max(kept, 0)
        batch = following


def rows(out: Any, label: torch.Tensor, kept: int) -> tuple[Any, torch.Tensor]:
    """The first `kept` rows of a padded batch's output and labels: of each tensor of the
    output with a row per label (its dim 0); other tensors (a 0-d auxiliary loss) as they are.

    Raises:
        ValueError: no tensor of the output has a row per label (a sequence-first output).
    """
    rows = len(label)
    cut: list[bool] = []

    def first(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == rows:
            cut.append(True)
            return t[:kept]
        return t

    trimmed = pytree.tree_map(first, out)
    if not cut:
        raise ValueError(
            f"Model.eval: the last batch holds {rows - kept} padding rows of a sharded dataset, "
            f"but no tensor of the network's output has a row per label (dim 0 of size {rows}) "
            "to leave them out; return batch-first outputs"
        )
    return trimmed, label[:kept]
