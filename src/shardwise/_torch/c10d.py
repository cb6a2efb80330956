"""c10d internals: backend options with a timeout, the default store, the fake process group;
the store classes.

- `BackendOptions`, `gloo_options`, `nccl_options`: ``DeviceMesh`` creates one process group
  per mesh dim with torch's 30-minute timeout unless given backend options per dim;
  `communication/mesh.py` gives them shardwise's timeout. Gloo's options class is only in
  ``torch._C._distributed_c10d``, and NCCL's options take the timeout as ``_timeout``.
- `default_store`: the store the default process group was made with; `communication/_init.py`
  runs its exit barrier through it (see `_init._store_barrier` for why not ``dist.barrier``), and
  `_store_sync.agree_on_group` its check before a group is created.
- `member_group_name`, `live_group_count`: the name torch gives a member-only group
  (``new_group(..., use_local_synchronization=True)``: a hash of its ranks and of how many
  process groups this process holds), under which its members meet in the store;
  `communication/_store_sync.py` has the members compare it before they create the group.
- `fake_process_group`: torch's test module that registers the ``"fake"`` backend (every
  collective returns at once) and its ``FakeStore``; a dry run (`communication/_dry.py`) plays
  one rank of a large job with it.
- `TCPStore`, `PrefixStore`, `Store`: the launcher's rendezvous (`launch/store.py`,
  `launch/rendezvous.py`). ``torch.distributed`` has the same classes, but its stubs do not
  export them (strict mypy refuses them there); imported from the C++ module they are typed.
"""

from __future__ import annotations

import datetime
import importlib
from types import ModuleType

import torch.distributed as dist
from torch._C._distributed_c10d import Backend, PrefixStore, Store, TCPStore

__all__ = [
    "BackendOptions",
    "PrefixStore",
    "Store",
    "TCPStore",
    "default_store",
    "fake_process_group",
    "gloo_options",
    "live_group_count",
    "member_group_name",
    "nccl_options",
]

BackendOptions = Backend.Options
"""A backend's options (``ProcessGroupNCCL.Options`` is one too)."""


def gloo_options(timeout: datetime.timedelta) -> BackendOptions:
    """Gloo's options carrying `timeout`."""
    return Backend.Options("gloo", timeout)


def nccl_options(timeout: datetime.timedelta) -> BackendOptions:
    """NCCL's options carrying `timeout` (only where torch was built with NCCL)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def default_store() -> Store:
    """The default process group's store.

    Raises:
        RuntimeError / ValueError: no default process group, or one without a store.
    """
    return dist.distributed_c10d._get_default_store()


def live_group_count() -> int:
    """How many process groups this process holds (the default one included)."""
    return len(dist.distributed_c10d._world.pg_names)


def member_group_name(ranks: list[int]) -> str:
    """The name torch would give a member-only group of the sorted global `ranks` now."""
    return str(dist.distributed_c10d._hash_ranks_to_str(sorted(ranks)))


def fake_process_group() -> ModuleType:
    """torch's fake process-group module (importing it registers the ``"fake"`` backend)."""
    return importlib.import_module("torch.testing._internal.distributed.fake_pg")
