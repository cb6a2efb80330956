"""Storage identity and sharing, below the public tensor API.

- `storage_key`: one int per storage, shared by all its views and tensor wrappers, that stays
  the same for the storage's life (the deferred-init tape, `parameter/_tape.py`, keys its roots
  by it: its roots are meta tensors, whose ``data_ptr()`` is 0).
- `storage_use_count`: how many tensors hold a storage (gradient buckets, `parallel/_runtime.py`,
  reuse a flat buffer only when no gradient handed out from it is still alive).
- `view_base`: the tensor a view was made from (optimizer parallel, `optim/_engine_gather.py`,
  finds a gathered weight from a view of it that autograd saves).
- `version`: a tensor's in-place change counter (optimizer parallel gathers a shard changed in
  place again; data-parallel mode finds parameters a train step changed).

`view_base` and `version` are ``operator.attrgetter``s: called per saved tensor or parameter,
they cost less than the attribute read they replace.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage behind ``tensor`` (shared by its views and wrappers)."""
    return int(tensor.untyped_storage()._cdata)


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) share `tensor`'s storage."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


view_base: Callable[[torch.Tensor], torch.Tensor | None] = operator.attrgetter("_base")
"""``t._base``: the tensor `t` is a view of (its root), None when `t` is not a view."""


version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""``t._version``: how many in-place changes `t`'s data (shared by its views) has had."""
