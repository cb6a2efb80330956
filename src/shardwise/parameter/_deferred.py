"""``sw.no_init_parameters()`` and materialization: build big networks without allocating.

- `no_init_parameters`: the context manager (``with sw.no_init_parameters():`` and
  MindSpore's ``with no_init_parameters:`` both work). Entering starts a `Session`, pushes
  the `Recorder` torch-function mode and global module-registration hooks that note which
  modules own deferred tensors; leaving records the exit RNG state and puts a forward
  pre-hook on every owner (`_AutoMaterialize`) so the first forward materializes everything
  (a forward on meta inputs only, such as a planner's shape trace, is let through untouched,
  and what it changes in place is not taken for a change after the block: `_MetaForwardEnd`).
  A deferred tensor changed in place after the block (``nn.init.zeros_(net.weight)``) is
  refused when materialized, naming it: the tape does not hold that change.
- `materialize`: replace the deferred tensors of a module (or one tensor) by real ones, in
  place (same objects, so optimizers created inside the block keep working), optionally
  only a slice per tensor (``slicer``) and on another device, or values computed elsewhere
  (``values``; a tensor of another class, such as a per-rank tensor, cannot take over the
  object: the module gets a new parameter and optimizers are re-pointed to it, `_replace`).
- `materialized_values`: the same values, returned by name without touching the module.
- `is_deferred`: whether a tensor is a recorded, not yet materialized, deferred tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import Any

import torch
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from shardwise._torch.module_state import own_buffers, own_parameters
from shardwise.parameter import _rng
from shardwise.parameter._blocks import DEFAULT_CHUNK_BYTES, Slicer
from shardwise.parameter._errors import DeferredInitError
from shardwise.parameter._parameter import assign_tensor
from shardwise.parameter._recorder import Recorder, patched_init_functions
from shardwise.parameter._replace import give
from shardwise.parameter._replay import Target, check_unchanged, compute
from shardwise.parameter._tape import Session, session_of

_LOCAL = threading.local()


def _active() -> Session | None:
    session: Session | None = getattr(_LOCAL, "session", None)
    return session


class _NoInitBlock:
    """One ``with`` block; nested blocks join the outer session."""

    def __init__(self) -> None:
        self._session: Session | None = None
        self._recorder: Recorder | None = None
        self._handles: list[RemovableHandle] = []
        self._patch: AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        if _active() is not None:
            return
        session = Session()
        session.note_device(torch.device("cpu"))
        self._session, self._recorder = session, Recorder(session)
        self._handles = _ownership_hooks(session)
        _LOCAL.session = session
        self._patch = patched_init_functions()
        self._patch.__enter__()
        self._recorder.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        session, recorder = self._session, self._recorder
        if session is None or recorder is None:
            return
        recorder.__exit__(exc_type, exc, traceback)
        if self._patch is not None:
            self._patch.__exit__(exc_type, exc, traceback)
        for handle in self._handles:
            handle.remove()
        _LOCAL.session = None
        session.finish_recording()
        if not session.root_device:
            session.close()
            return
        for owner in list(session.owners):
            session.hooks.append(owner.register_forward_pre_hook(_AutoMaterialize(session)))
            end = _MetaForwardEnd(session)
            session.hooks.append(owner.register_forward_hook(end, always_call=True))


def _ownership_hooks(session: Session) -> list[RemovableHandle]:
    def note(module: torch.nn.Module, name: str, value: Any) -> None:
        if _active() is session:
            session.owners.add(module)

    return [
        module_hooks.register_module_parameter_registration_hook(note),
        module_hooks.register_module_buffer_registration_hook(note),
        module_hooks.register_module_module_registration_hook(note),
    ]


class _NoInitParameters:
    """``sw.no_init_parameters``: call it for a context manager, or use it directly."""

    def __call__(self) -> _NoInitBlock:
        """A context manager: inside it, parameters and buffers are recorded, not allocated.

        Returns:
            The block; ``with`` it around network (and optimizer) construction.

        Example:
            >>> with no_init_parameters():
            ...     net = torch.nn.Linear(4096, 4096)
            >>> net.weight.is_meta
            True
            >>> _ = materialize(net)
            >>> net.weight.is_meta
            False
        """
        return _NoInitBlock()

    def __enter__(self) -> None:
        blocks: list[_NoInitBlock] = getattr(_LOCAL, "bare_blocks", [])
        _LOCAL.bare_blocks = blocks
        block = _NoInitBlock()
        blocks.append(block)
        block.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _LOCAL.bare_blocks.pop().__exit__(exc_type, exc, traceback)


no_init_parameters = _NoInitParameters()


_TRACING = [0]  # > 0: forwards are traced (planner.capture), nothing materializes


@contextmanager
def tracing() -> Iterator[None]:
    """While the block runs, a forward of a network built in ``no_init_parameters()`` computes
    nothing (it is traced on fake tensors) and does not materialize it."""
    _TRACING[0] += 1
    try:
        yield
    finally:
        _TRACING[0] -= 1


class _AutoMaterialize:
    """Forward pre-hook: materialize the whole session before the first forward."""

    def __init__(self, session: Session) -> None:
        self._session: Session | None = session

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        session = self._session
        if session is None or session.closed or _TRACING[0]:
            return
        if _meta_call(args):
            if not session.meta_forwards:  # (changes made before it are the user's)
                session.note_changes()
            session.meta_forwards += 1
            return
        targets = _owner_targets(session)
        if targets:
            _assign(targets, compute(session, targets))
        session.close()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._session = None


class _MetaForwardEnd(_AutoMaterialize):
    """Forward hook: after a forward on meta inputs, whatever it changed in place (a training
    BatchNorm's ``num_batches_tracked``) is not a user's change made after the block."""

    def __call__(self, module: torch.nn.Module, args: Any, output: Any = None) -> None:
        session = self._session
        if session is None or session.closed or _TRACING[0] or not _meta_call(args):
            return
        session.meta_forwards -= 1
        if not session.meta_forwards:
            session.keep_versions()


def _meta_call(args: Any) -> bool:
    """Whether a forward gets only meta tensors (shape tracing, e.g. AutoParallel's plan):
    it computes nothing, so it neither needs values nor ends the session."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)] if isinstance(args, tuple) else []
    return bool(tensors) and all(t.is_meta for t in tensors)


def _owner_targets(session: Session) -> list[Target]:
    targets: list[Target] = []
    seen: set[int] = set()
    for owner in list(session.owners):
        prefix = type(owner).__name__
        tensors = [*own_parameters(owner).items(), *own_buffers(owner).items()]
        for name, tensor in tensors:
            if tensor is None or id(tensor) in seen or session_of(tensor) is not session:
                continue
            seen.add(id(tensor))
            targets.append(Target(f"{prefix}.{name}", tensor, session.ref(tensor)))
    return targets


def _named_deferred(obj: torch.nn.Module | torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        name = getattr(obj, "name", None)
        return [(name if isinstance(name, str) else "", obj)] if obj.is_meta else []
    if not isinstance(obj, torch.nn.Module):
        raise TypeError(f"expected an nn.Module or a tensor, got {type(obj).__name__}")
    named = [*obj.named_parameters(), *obj.named_buffers()]
    return [(name, tensor) for name, tensor in named if tensor.is_meta]


def _group(obj: torch.nn.Module | torch.Tensor) -> dict[Session, list[Target]]:
    groups: dict[Session, list[Target]] = {}
    unknown: list[str] = []
    for name, tensor in _named_deferred(obj):
        session = session_of(tensor)
        if session is None:
            unknown.append(name or "<tensor>")
            continue
        groups.setdefault(session, []).append(Target(name, tensor, session.ref(tensor)))
    if unknown:
        raise DeferredInitError(
            f"cannot materialize {', '.join(unknown)}: meta tensors that no open "
            "sw.no_init_parameters() block recorded (or whose block was already materialized)"
        )
    return groups


def _assign(targets: list[Target], values: list[torch.Tensor]) -> None:
    for target, value in zip(targets, values, strict=True):
        assign_tensor(target.tensor, value)


def _finish(session: Session) -> None:
    if session.owners and not _owner_targets(session):
        session.close()


def materialize(
    obj: torch.nn.Module | torch.Tensor,
    *,
    slicer: Slicer | None = None,
    device: torch.device | str | None = None,
    values: Mapping[str, torch.Tensor] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Any:
    """Give ``obj``'s deferred parameters and buffers real values, in place.

    Values are bit-identical to an eager build after the same ``torch.manual_seed``: the
    recorded construction is replayed in order from the RNG state at block entry. The
    tensor objects are kept (their data is swapped), so optimizers built inside the block
    keep working. Called automatically before the first forward of a recorded module.

    Args:
        obj: an ``nn.Module`` (all its deferred parameters and buffers) or one tensor.
        slicer: optional ``slicer(name, full_shape) -> index``; each tensor then keeps only
            ``full[index]`` (a copy), e.g. this rank's shard. ``None`` from it = keep whole.
            Where the index is one step-1 slice per dimension, the tensor is generated in
            chunks and only its block is ever held (see docs/parallel.md, "Delayed init").
        device: move the values there (they are generated where construction would have
            put them, normally the CPU, so the random stream is the eager one).
        values: the values to give instead of replaying, by name, as `materialized_values`
            returns them (e.g. computed per rank and joined by
            ``shardwise.communication.rank_value``); then `slicer` and `device` must be None.
            A value whose class is not ``torch.Tensor`` (a per-rank tensor) cannot take over
            the object: ``obj`` (a module) gets a new ``nn.Parameter`` or buffer holding it, and
            an optimizer holding the old object steps the new one from its next step on.
        chunk_bytes: the buffer random fills of sliced tensors draw through (4 MiB by
            default); 0 generates every tensor whole before cutting it.

    Returns:
        ``obj``.

    Raises:
        ValueError: `values` with a `slicer` or `device`, or without the value of a deferred
            tensor of ``obj``.
        DeferredInitError: (a ``ValueError``) a deferred tensor changed in place after the
            block (``nn.init.zeros_(net.weight)``): the record does not hold that change.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> with no_init_parameters():
        ...     net = torch.nn.Linear(8, 4)
        >>> _ = materialize(net, slicer=lambda name, shape: slice(0, shape[0] // 2))
        >>> net.weight.shape
        torch.Size([2, 8])
    """
    if values is not None and (slicer is not None or device is not None):
        raise ValueError("materialize: pass values, or a slicer / device to replay with")
    target_device = None if device is None else _rng.normalize_device(device)
    groups = _group(obj)
    for session, targets in groups.items():  # (all refused before any is given values)
        check_unchanged(session, targets)
        missing = [t.name for t in targets if values is not None and t.name not in values]
        if missing:
            raise ValueError(f"materialize: no value for {', '.join(missing)}")
    for session, targets in groups.items():
        if values is None:
            _assign(targets, compute(session, targets, slicer, target_device, chunk_bytes))
        else:
            give(obj, targets, [values[t.name] for t in targets])
        _finish(session)
    return obj


def materialized_values(
    obj: torch.nn.Module | torch.Tensor,
    *,
    slicer: Slicer | None = None,
    device: torch.device | str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, torch.Tensor]:
    """The values `materialize` would give, by name, leaving ``obj`` deferred.

    Args:
        obj: an ``nn.Module`` or one deferred tensor (named ``""`` or its ``.name``).
        slicer: as for `materialize`.
        device: as for `materialize`.
        chunk_bytes: as for `materialize`.

    Returns:
        ``{name: value}`` for every deferred parameter and buffer.

    Example:
        >>> with no_init_parameters():
        ...     net = torch.nn.Linear(8, 4)
        >>> sorted(materialized_values(net))
        ['bias', 'weight']
    """
    target_device = None if device is None else _rng.normalize_device(device)
    result: dict[str, torch.Tensor] = {}
    for session, targets in _group(obj).items():
        values = compute(session, targets, slicer, target_device, chunk_bytes)
        result.update((t.name, v) for t, v in zip(targets, values, strict=True))
    return result


def is_deferred(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` was recorded by ``no_init_parameters`` and is not materialized."""
    return session_of(tensor) is not None
