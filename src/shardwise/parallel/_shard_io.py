"""Which of a call's tensors each entry of ``sw.shard``'s strategies is for, and the resharding.

- `reshard_inputs`: `in_strategy` has one entry per tensor argument of the call: the positional
  ones, then those passed by keyword in the order the signature (a module's ``forward``) lists
  them, then those a ``**kwargs`` takes, in the order passed; or one per positional tensor
  only, the tensors passed by keyword then coming as they are.
- `reshard_outputs`: `out_strategy` has one entry per returned tensor (a tensor, or a tuple /
  list of values).

Both check the count at every call (a ValueError naming the call's tensors) and, inside a
wrapped call (`session` not None), reshard each tensor to its entry; elsewhere they return the
values unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from shardwise.layout import TensorLayout
from shardwise.parallel._shard_labels import ShardLabels

Entry = tuple[int, ...] | TensorLayout
Key = int | str  # a positional argument's index, or the keyword an argument was passed by

_OP_FORM_HINT = (
    " of its forward (an entry for its weight too is the op form, for nn.Linear and "
    "nn.Embedding only: annotate the op inside it with sw.ops primitives)"
)


class Resharder(Protocol):
    """What the resharding needs from the running `AutoParallel` (`_shard.Session`)."""

    def reshard(
        self, t: torch.Tensor, entry: Entry, who: str = "sw.reshard", what: str = ""
    ) -> torch.Tensor: ...


def reshard_inputs(
    args: Sequence[Any],
    kwargs: dict[str, Any],
    strategy: Sequence[Entry] | None,
    labels: ShardLabels,
    session: Resharder | None,
    module: bool = False,
) -> tuple[list[Any], dict[str, Any]]:
    """The call's arguments with its tensors resharded to `strategy`'s entries (`labels`: how
    messages name the call and each entry; `module`: the call is a module's).

    Raises:
        ValueError: `strategy` has neither one entry per tensor argument nor one per
            positional tensor argument.
    """
    if strategy is None:
        return list(args), kwargs
    positions: list[Key] = [i for i, v in enumerate(args) if isinstance(v, torch.Tensor)]
    keywords = labels.keyword_order([k for k, v in kwargs.items() if isinstance(v, torch.Tensor)])
    if len(strategy) == len(positions):
        keys = positions
    elif len(strategy) == len(positions) + len(keywords):
        keys = [*positions, *keywords]
    else:
        raise _count_error(len(strategy), positions, keywords, labels, module)
    out_args, out_kwargs = list(args), dict(kwargs)
    if session is None:
        return out_args, out_kwargs
    for k, (key, entry) in enumerate(zip(keys, strategy, strict=True)):
        label = labels.entry("in_strategy", k, key)
        if isinstance(key, int):
            out_args[key] = session.reshard(args[key], entry, labels.who, label)
        else:
            out_kwargs[key] = session.reshard(kwargs[key], entry, labels.who, label)
    return out_args, out_kwargs


def _count_error(
    entries: int, positions: list[Key], keywords: list[str], labels: ShardLabels, module: bool
) -> ValueError:
    names = ", ".join(labels.argument(i) for i in positions)
    if keywords:
        names += ("; " if names else "") + "by keyword: " + ", ".join(keywords)
    total = len(positions) + len(keywords)
    message = (
        f"{labels.who}: in_strategy has {entries} entries but the call has {total} tensor "
        f"inputs ({names}); give one per tensor"
    )
    if module and entries > total:
        message += _OP_FORM_HINT
    if keywords:
        message += (
            f": the positional ones, then those passed by keyword in the order the signature "
            f"lists them; or one per positional tensor only ({len(positions)}), those passed "
            f"by keyword then coming as they are"
        )
    return ValueError(message)


def reshard_outputs(
    out: Any, strategy: Sequence[Entry] | None, labels: ShardLabels, session: Resharder | None
) -> Any:
    """The call's result `out` with its tensors resharded to `strategy`'s entries.

    Raises:
        ValueError: `strategy` does not have one entry per returned tensor.
        TypeError: `out` is neither a tensor nor a tuple / list.
    """
    if strategy is None:
        return out
    if isinstance(out, torch.Tensor):
        return _reshard_outputs([out], strategy, labels, session)[0]
    if isinstance(out, tuple | list):
        return type(out)(_reshard_outputs(list(out), strategy, labels, session))
    raise TypeError(f"{labels.who}: out_strategy given but the call returned {type(out).__name__}")


def _reshard_outputs(
    values: list[Any], strategy: Sequence[Entry], labels: ShardLabels, session: Resharder | None
) -> list[Any]:
    positions = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if len(strategy) != len(positions):
        raise ValueError(
            f"{labels.who}: out_strategy has {len(strategy)} entries but the call has "
            f"{len(positions)} tensor outputs; give one per tensor"
        )
    if session is None:
        return values
    out = list(values)
    for k, (i, entry) in enumerate(zip(positions, strategy, strict=True)):
        out[i] = session.reshard(values[i], entry, labels.who, labels.entry("out_strategy", k))
    return out
