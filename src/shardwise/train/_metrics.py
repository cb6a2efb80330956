"""`Model.eval`'s metrics: `Accuracy`, `Loss`, and `make_metrics` (names -> factories).

Each metric keeps counts (`counts()`: `Accuracy` a sum of hits and of rows, `_Mean`; `Loss`
each batch's loss times its rows and its rows); `Model.eval` sums them over the ranks when the
dataset is sharded, then asks the metric for its value (`result`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def _no_rows(metric: str) -> str:
    return (
        f"Model.eval: the {metric} metric counted no rows: the dataset gave none (empty, or "
        "batch(..., drop_remainder=True) dropped them all); give it at least one row (MindSpore's "
        "metrics refuse an empty evaluation too)"
    )


class _Mean:
    """A sum (a float64 tensor: per rank in a simulated world) and a count, added batch by
    batch; the result is their ratio (a ValueError when nothing was counted)."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.total = 0.0

    def add(self, value: torch.Tensor, count: float) -> None:
        self.sum = value if self.sum is None else self.sum + value
        self.total += count

    def counts(self) -> torch.Tensor:
        total = self.sum if self.sum is not None else torch.zeros((), dtype=torch.float64)
        count = torch.full((), self.total, dtype=torch.float64, device=total.device)
        return torch.stack([total, count])

    def result(self, counts: torch.Tensor) -> float:
        if not float(counts[1]):
            raise ValueError(_no_rows(type(self).__name__))
        return float(counts[0] / counts[1])


class Accuracy(_Mean):
    """Top-1 accuracy: argmax of the logits against the labels: class indices of shape
    ``(N,)`` (or ``(N, 1)``), or one-hot / probability rows of the logits' shape (their argmax),
    as MindSpore's ``Accuracy`` takes them."""

    def update(
        self, logits: torch.Tensor, labels: torch.Tensor, whole: tuple[Any, Any] | None = None
    ) -> None:
        """Add a batch's counted rows (`whole`, the batch with its padding rows, is unused)."""
        if not isinstance(logits, torch.Tensor):
            shown = type(logits).__name__
            if isinstance(logits, tuple | list):
                shown = f"a {shown} of {len(logits)} outputs"
            raise TypeError(
                f"Model.eval: the 'accuracy' metric reads the network's output as one tensor "
                f"of logits, got {shown}; as MindSpore's Model (whose metrics read the network's "
                "output as it is, without an eval_network and eval_indexes to pick one), "
                "return the logits alone in eval mode (`if not self.training: return logits`) "
                "or evaluate a network that does, e.g. one wrapping it and returning its [0]"
            )
        if logits.shape[0] != labels.shape[0]:
            raise ValueError(
                f"Accuracy: {logits.shape[0]} predictions for {labels.shape[0]} labels; the "
                "network must return one row of logits per sample"
            )
        if labels.dim() > 1 and labels.shape == logits.shape and logits.shape[-1] > 1:
            labels = labels.argmax(dim=-1)  # (one-hot rows)
        elif labels.dim() == 2 and labels.shape[1] == 1:
            labels = labels[:, 0]
        if labels.dtype in (torch.uint16, torch.uint32, torch.uint64):  # (MNIST's uint32)
            labels = labels.to(torch.int64)  # (torch compares no int64 with them)
        predicted = logits.argmax(dim=-1)
        if labels.shape != predicted.shape:
            raise ValueError(
                f"Accuracy: labels of shape {list(labels.shape)} for logits of shape "
                f"{list(logits.shape)}; give class indices of shape {list(predicted.shape)} or "
                "one-hot rows of the logits' shape"
            )
        hits = (predicted == labels).sum().to(torch.float64)
        self.add(hits, float(labels.shape[0]))


class Loss:
    """The mean of `loss_fn`'s value over the batches (MindSpore's ``Loss`` metric: each
    batch's loss, its mean when it has several values, counted once). On a dataset sharded over
    the ranks a batch is the ranks' parts of one global batch: its loss is their rows' mean,
    each part weighted by its rows (one device's value for a loss averaged over its rows; the
    short last batch included), so each batch is kept apart until the ranks' are summed."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.sums: list[torch.Tensor] = []  # per batch: its mean loss times its rows
        self.rows: list[float] = []

    def update(
        self, logits: torch.Tensor, labels: torch.Tensor, whole: tuple[Any, Any] | None = None
    ) -> None:
        """Add a batch: `logits` and `labels` its counted rows, `whole` the whole batch (a
        sharded last batch's padding rows included), on which `loss_fn` still runs where no
        row is counted: a loss whose collectives every rank must call (the README's
        ``AllReduce(loss) / n``) then does not wait for this rank. Its value is not counted
        here, but such a loss carries it into the other ranks' values of that batch."""
        rows = float(labels.shape[0])
        if not rows:  # (a rank's share of a short last batch may be empty: no NaN mean)
            if whole is not None:
                self.loss_fn(*whole)
            self.sums.append(torch.zeros((), dtype=torch.float64, device=logits.device))
        else:
            mean = self.loss_fn(logits, labels).detach().to(torch.float64).mean()
            self.sums.append(mean * rows)
        self.rows.append(rows)

    def counts(self) -> torch.Tensor:
        if not self.sums:
            return torch.zeros((2, 0), dtype=torch.float64)
        sums = torch.stack(self.sums)
        rows = torch.tensor(self.rows, dtype=torch.float64, device=sums.device)
        return torch.stack([sums, rows])

    def padded(self, counts: torch.Tensor, batches: int) -> torch.Tensor:
        """`counts` with empty batches after its own, up to `batches` (ranks of a dataset that
        gave some of them fewer batches: the sums over the ranks need one length)."""
        short = batches - counts.shape[1]
        if short <= 0:
            return counts
        return torch.cat([counts, counts.new_zeros((2, short))], dim=1)

    def result(self, counts: torch.Tensor) -> float:
        kept = counts[1] > 0
        if not bool(kept.any()):
            raise ValueError(_no_rows("Loss"))
        return float((counts[0][kept] / counts[1][kept]).mean())


METRICS: dict[str, Callable[[], Accuracy]] = {"accuracy": Accuracy, "acc": Accuracy}


def make_metrics(
    metrics: Iterable[str] | dict[str, Any] | None, loss_fn: Callable[..., torch.Tensor] | None
) -> dict[str, Callable[[], Any]]:
    if metrics is None:
        return {}
    names = [metrics] if isinstance(metrics, str) else list(metrics)  # ("accuracy" alone)
    unknown = [m for m in names if m not in METRICS and m != "loss"]
    if unknown:
        raise ValueError(f"Model: unknown metrics {unknown}; known: {sorted([*METRICS, 'loss'])}")
    made: dict[str, Callable[[], Any]] = {m: METRICS[m] for m in names if m in METRICS}
    if "loss" in names:
        if loss_fn is None:
            raise ValueError("Model: the 'loss' metric needs loss_fn= (the network's loss)")
        made["loss"] = lambda: Loss(loss_fn)
    return made
