"""The tape of one ``no_init_parameters`` session: what was done to which deferred storage.

Deferred tensors are meta tensors. Everything that shares a meta *storage* (a parameter,
its ``.data``, views such as ``weight[0]``) is one "root", identified by a session-local
id; a reference to a tensor is ``(root id, size, stride, offset, dtype)`` (`TensorRef`),
so views and ``Parameter`` wrappers need no bookkeeping of their own.

- `TensorRef`, `RecordedOp`, `RngReset`: the tape entries.
- `Session`: the tape, the roots (with the device each would have been created on), the
  RNG states at entry/exit, the modules that own deferred tensors, and `Session.encode`
  (tensor arguments -> `TensorRef`), `Session.sync_rng` (record reseeds); each root's
  in-place change count at exit (`Session.changed`: a root changed after the block, where
  nothing records it, would lose that change when replayed).
- `session_of`: which open session a meta tensor belongs to (global registry by storage).
- `flatten`, `iter_tensors`: the tiny pytree helpers the recorder and replay share.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from shardwise._torch.storage import storage_key, version
from shardwise.parameter import _rng
from shardwise.parameter._errors import DeferredInitError


@dataclass(frozen=True)
class TensorRef:
    """A tensor view of a deferred root: ``as_strided(root, size, stride, offset)``."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class RecordedOp:
    """``func(*args, **kwargs)`` with `TensorRef`s; ``outputs`` = (leaf index, new root)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[tuple[int, TensorRef], ...]


@dataclass(frozen=True)
class RngReset:
    """The generator of ``device`` was reseeded (or used for real) during construction."""

    device: torch.device
    state: torch.Tensor


TapeEntry = RecordedOp | RngReset


def layout_of(tensor: torch.Tensor, key: int) -> TensorRef:
    """The `TensorRef` describing ``tensor`` as a view of root ``key``."""
    return TensorRef(
        key, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()), tensor.dtype
    )


def flatten(value: Any) -> list[Any]:
    """Leaves of nested tuples/lists (including torch's named return tuples), in order."""
    if isinstance(value, tuple | list) and not isinstance(value, torch.Size):
        return [leaf for item in value for leaf in flatten(item)]
    return [value]


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)


_REGISTRY: dict[int, Session] = {}
_REGISTRY_LOCK = threading.Lock()


def session_of(tensor: torch.Tensor) -> Session | None:
    """The open session that recorded ``tensor``'s storage, if any."""
    if not tensor.is_meta:
        return None
    return _REGISTRY.get(storage_key(tensor))


@dataclass(eq=False)
class Session:
    """Everything recorded by one outermost ``no_init_parameters`` block."""

    tape: list[TapeEntry] = field(default_factory=list)
    root_device: dict[int, torch.device] = field(default_factory=dict)
    entry_states: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    exit_states: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    owners: weakref.WeakSet[torch.nn.Module] = field(default_factory=weakref.WeakSet)
    hooks: list[RemovableHandle] = field(default_factory=list)
    recording: bool = True
    closed: bool = False
    meta_forwards: int = 0  # forwards on meta inputs running now (nested)
    _keys: dict[int, int] = field(default_factory=dict)
    _alive: list[torch.Tensor] = field(default_factory=list)
    _last_states: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    _versions: list[int] = field(default_factory=list)  # each root's, by key, when recorded
    _changed: set[int] = field(default_factory=set)

    def knows(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of one of this session's roots."""
        return tensor.is_meta and storage_key(tensor) in self._keys

    def ref(self, tensor: torch.Tensor) -> TensorRef:
        """The `TensorRef` of a known tensor."""
        return layout_of(tensor, self._keys[storage_key(tensor)])

    def new_root(self, tensor: torch.Tensor, device: torch.device) -> TensorRef:
        """Register ``tensor``'s (new, meta) storage as a root created for ``device``."""
        cdata = storage_key(tensor)
        key = len(self._keys)
        self._keys[cdata] = key
        self._alive.append(tensor.detach())  # keeps the storage (and its id) alive
        self.root_device[key] = device
        with _REGISTRY_LOCK:
            _REGISTRY[cdata] = self
        return layout_of(tensor, key)

    def device_of(self, value: Any) -> torch.device:
        """The intended device of the first known tensor in ``value`` (CPU if none)."""
        for tensor in iter_tensors(value):
            if self.knows(tensor):
                return self.root_device[self._keys[storage_key(tensor)]]
        return torch.device("cpu")

    def note_device(self, device: torch.device) -> None:
        """Start tracking ``device``'s generator (its state now is the entry state)."""
        if device not in self.entry_states and _rng.has_generator(device):
            state = _rng.get_state(device)
            self.entry_states[device] = state
            self._last_states[device] = state

    def sync_rng(self) -> None:
        """Record a `RngReset` for every generator changed since the last recorded op."""
        for device, last in self._last_states.items():
            now = _rng.get_state(device)
            if not torch.equal(now, last):
                self.tape.append(RngReset(device, now))
                self._last_states[device] = now

    def finish_recording(self) -> None:
        """Called at context exit: record trailing reseeds and the exit states."""
        self.sync_rng()
        self.exit_states = dict(self._last_states)
        self.recording = False
        self.keep_versions()

    def keep_versions(self) -> None:
        """Take each root's in-place change count (``_version``, shared by its views and
        ``Parameter`` wrappers, bumped on meta tensors too) as its recorded one."""
        self._versions = [version(root) for root in self._alive]  # (index = root key)

    def note_changes(self) -> None:
        """Remember the roots changed since `keep_versions`, before it runs again (a forward on
        meta inputs changes buffers, ``num_batches_tracked``, that no user changed)."""
        self._changed.update(k for k in range(len(self._versions)) if self._changed_now(k))

    def changed(self, key: int) -> bool:
        """Whether root `key` was changed in place after the block (``nn.init.zeros_(w)``,
        ``w.copy_(t)``), which no tape holds."""
        return key in self._changed or self._changed_now(key)

    def _changed_now(self, key: int) -> bool:
        return key < len(self._versions) and version(self._alive[key]) != self._versions[key]

    def encode(self, value: Any) -> Any:
        """``value`` with every known meta tensor replaced by its `TensorRef`."""
        if isinstance(value, torch.Tensor):
            if not value.is_meta:
                return value
            if not self.knows(value):
                raise DeferredInitError(
                    "a meta tensor that was not created inside this no_init_parameters block "
                    f"(shape {list(value.shape)}) was mixed with deferred tensors"
                )
            return self.ref(value)
        if type(value) is tuple or type(value) is list:
            return type(value)(self.encode(item) for item in value)
        if type(value) is dict:
            return {name: self.encode(item) for name, item in value.items()}
        return value

    def close(self) -> None:
        """Forget the tape and the roots; remove the auto-materialize hooks."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        with _REGISTRY_LOCK:
            for cdata in self._keys:
                if _REGISTRY.get(cdata) is self:
                    del _REGISTRY[cdata]
        self.tape.clear()
        self._alive.clear()
        self.closed = True
