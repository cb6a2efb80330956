"""Checks of what `Model` is given: its `loss_fn` (`check_loss_fn`), `Model.train`'s counts
(`check_train_args`), an epoch without batches (`check_batches`; a later epoch of a used-up
iterator: `check_epoch_yielded`), each batch's columns
(`columns`) and their count against the network's ``forward`` (`call_network`), the loss a
step computes (`step_loss`; both for one batch: `batch_loss`), the callbacks
(`callback_list`), and one metric value from a simulated world's ranks (`one_value`)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardwise import communication as comm
from shardwise.train import callbacks as cb


def check_train_args(epoch: object, initial_epoch: object, sink_size: object) -> None:
    """Raise ValueError for `Model.train`'s counts out of range (MindSpore's meanings)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise ValueError(f"Model.train: epoch={epoch!r} must be an int >= 1")
    if (
        isinstance(initial_epoch, bool)
        or not isinstance(initial_epoch, int)
        or not 0 <= initial_epoch < epoch
    ):
        raise ValueError(
            f"Model.train: initial_epoch={initial_epoch!r} must be an int in [0, {epoch})"
        )
    if isinstance(sink_size, bool) or not isinstance(sink_size, int) or sink_size in (0,):
        raise ValueError(f"Model.train: sink_size={sink_size!r} must be -1 or an int >= 1")
    if sink_size < -1:
        raise ValueError(f"Model.train: sink_size={sink_size!r} must be -1 or an int >= 1")


def check_batches(data: object, batches: int | None) -> None:
    """Raise ValueError when `data` yields no batch in an epoch (`batches`: its ``len()``, or
    the steps an epoch of a dataset without one ran; None: not known yet)."""
    if batches != 0:
        return
    note = getattr(data, "size_note", None)
    said = f" ({note()})" if callable(note) else ""
    fix = "give it more rows, a smaller batch_size or drop_remainder=False"
    if isinstance(data, Iterator):
        fix = (
            f"an iterator yields its batches once (a {type(data).__name__}, empty or used up by "
            "an earlier train() call): pass data that each epoch iterates from the start, a "
            "list of batches, a torch DataLoader or a sw.dataset pipeline"
        )
    raise ValueError(
        f"Model.train: the dataset yields no batch in an epoch{said}, so nothing would train; {fix}"
    )


def check_epoch_yielded(data: object, epoch: int, steps: int, batch_num: int) -> None:
    """Raise ValueError when `data`, of `batch_num` batches an epoch (its ``len()``, or what an
    earlier epoch yielded), yields none in `epoch` (`steps`: the batches it yielded): an
    iterator used up by an earlier epoch would train no further, silently."""
    if steps or not batch_num:
        return
    raise ValueError(
        f"Model.train: the dataset (a {type(data).__name__}) yielded no batch in epoch {epoch}, "
        f"where an epoch has {batch_num}: it cannot be iterated again (a generator or iterator "
        "is used up by its first epoch); pass data that each epoch iterates from the start: a "
        "list of batches, a torch DataLoader, or a sw.dataset pipeline (GeneratorDataset of a "
        "generator function, which is called again every epoch)"
    )


def columns(batch: object, least: int, who: str = "train") -> Sequence[Any]:
    """A batch's columns ``(*inputs, label)``, else TypeError naming the form (a tensor or a
    one-column row was unpacked element by element into the network's arguments)."""
    if not isinstance(batch, tuple | list) or len(batch) < least:
        shown = f"a {type(batch).__name__}"
        if isinstance(batch, tuple | list):
            shown = f"{len(batch)} column(s)"
        elif isinstance(batch, torch.Tensor):
            shown = f"a tensor of shape {list(batch.shape)}"
        form = "(*inputs, label)" if least > 1 else "(*inputs,)"
        raise TypeError(
            f"Model.{who}: each batch must be a tuple {form} of tensors (a dataset's "
            f"columns), got {shown}; e.g. GeneratorDataset(rows, ['image', 'label'])"
        )
    return batch


def check_loss_fn(loss_fn: object) -> None:
    """TypeError for a `Model` ``loss_fn`` that cannot be called (a loss's name, a class)."""
    if loss_fn is None or (callable(loss_fn) and not isinstance(loss_fn, type)):
        return
    fix = "torch.nn.CrossEntropyLoss()"
    if isinstance(loss_fn, type):
        fix = f"an instance, {loss_fn.__name__}()"
    raise TypeError(
        f"Model: loss_fn={loss_fn!r} must be callable as loss_fn(network output, label) (a loss "
        f"module or a function), or None when the network returns the loss itself; pass {fix}"
    )


def call_network(network: torch.nn.Module, inputs: Sequence[Any], label: bool, who: str) -> Any:
    """``network(*inputs)``; when its ``forward`` does not take that many inputs, a TypeError
    naming the batch's column count and ``forward``'s parameters (torch's own error names
    neither the columns nor the fix)."""
    try:
        return network(*inputs)
    except TypeError as e:
        if _takes(network, inputs) or _inside_forward(e, network):  # (torch's error stands)
            raise
        signature = inspect.signature(network.forward)
        shown = signature.replace(return_annotation=inspect.Signature.empty)
        name = f"{type(network).__name__}.forward{shown}"
        read = f"{len(inputs)} input(s) and the label (the last column, for loss_fn)"
        if not label:
            read = f"{len(inputs)} input(s) (loss_fn=None: all columns go to the network)"
        raise TypeError(
            f"Model.{who}: each batch has {len(inputs) + label} column(s), passed as {read}, "
            f"but {name} does not take {len(inputs)} positional input(s); give the dataset the "
            "network's inputs (and the label last) as its columns, e.g. GeneratorDataset(rows, "
            "['image', 'label'])"
        ) from None


def _inside_forward(error: BaseException, network: torch.nn.Module) -> bool:
    """Whether `error` was raised with ``network.forward`` running (its frame in the
    traceback: a forward pre-hook may have passed other inputs than the batch's), not by the
    call of it (a decorated ``forward``: its own code, under the decorator's wrapper)."""
    forward = getattr(type(network), "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def _takes(network: torch.nn.Module, inputs: Sequence[Any]) -> bool:
    """Whether ``network.forward`` takes `inputs` (True when it has no signature to read)."""
    try:
        inspect.signature(network.forward).bind(*inputs)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def batch_loss(network: torch.nn.Module, loss_fn: Any, batch: Sequence[Any]) -> torch.Tensor:
    """The loss of one training `batch`: ``network(*batch)`` with `loss_fn` None, else
    ``loss_fn(network(*inputs), label)`` with the label the last column (`call_network`,
    `step_loss`)."""
    if loss_fn is None:
        return step_loss(call_network(network, batch, False, "train"), loss_fn)
    *inputs, label = batch
    return step_loss(loss_fn(call_network(network, inputs, True, "train"), label), loss_fn)


def step_loss(out: Any, loss_fn: object) -> torch.Tensor:
    """The loss of a step's `out` (the network's, with `loss_fn` None, else `loss_fn`'s): the
    tensor itself, a tuple's or list's first item (``(loss, logits)``, as `LossMonitor` reads
    it), or a mapping's ``"loss"`` tensor (a Hugging Face ``ModelOutput`` of a model given its
    labels); TypeError or ValueError naming the fix for anything else."""
    who = "the network (loss_fn=None)" if loss_fn is None else "loss_fn"
    loss = out[0] if isinstance(out, tuple | list) and out else out
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        loss = out["loss"]
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"Model.train: {who} returned {type(out).__name__}; it must return the loss "
            "tensor, a tuple whose first item is the loss, e.g. (loss, logits), or a mapping "
            "(a Hugging Face ModelOutput: pass labels) whose 'loss' is it"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"Model.train: {who} returned a loss of shape {list(loss.shape)}, not one value; "
            "reduce it over the batch (e.g. reduction='mean', or loss.mean())"
        )
    return loss


def one_value(counts: torch.Tensor, name: str) -> torch.Tensor:
    """`counts` as one tensor; in a simulated world the ranks' common counts (a ValueError when
    each rank counted its own rows: one number cannot hold them all)."""
    if not (comm.is_initialized() and comm.holds_several_ranks()):
        return counts
    same = comm.shared_value(counts)
    if same is None:
        raise ValueError(
            f"Model.eval: each rank of this simulated world counted its own rows for {name!r}, "
            "and one process cannot return each rank's value: evaluate a dataset sharded over "
            "the ranks (num_shards=N: the counts are summed over them), every rank's rows "
            "whole (world.same), or outside the world"
        )
    return same


def callback_list(callbacks: object) -> list[cb.Callback]:
    """`callbacks` as a list of `Callback` instances, else TypeError naming the entry and the
    fix (a class passed for an instance, a name)."""
    if isinstance(callbacks, cb.Callback):
        return [callbacks]
    if callbacks is None:
        return []
    if isinstance(callbacks, str) or not isinstance(callbacks, Iterable):
        raise TypeError(
            f"Model.train: callbacks={callbacks!r} must be a Callback or a list of them, e.g. "
            "[sw.train.LossMonitor()]"
        )
    out = list(callbacks)
    for c in out:
        if isinstance(c, type) and issubclass(c, cb.Callback):
            raise TypeError(
                f"Model.train: callbacks holds the class {c.__name__}; pass an instance, "
                f"{c.__name__}()"
            )
        if not isinstance(c, cb.Callback):
            raise TypeError(
                f"Model.train: callbacks holds {c!r}, not a Callback; pass instances such as "
                "sw.train.LossMonitor()"
            )
    return out


def one_dataset(where: str, given: Any, alias: Any, names: tuple[str, str]) -> Any:
    """The dataset passed to `where` under MindSpore's name (`given`, ``names[0]``) or the
    contract's (`alias`, ``names[1]``: ``dataset``), exactly one of them.

    Raises:
        TypeError: both, or neither.
    """
    if given is not None and alias is not None:
        raise TypeError(f"{where}: pass the dataset once, as {names[0]}= or {names[1]}=")
    if given is None and alias is None:
        raise TypeError(f"{where}: missing the dataset ({names[0]}= or {names[1]}=)")
    return given if given is not None else alias
