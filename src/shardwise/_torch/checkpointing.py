"""Whether an op runs inside activation checkpointing (``torch.utils.checkpoint``).

Non-reentrant checkpointing (``checkpoint(fn, use_reentrant=False)``, ``checkpoint_wrapper``,
the composable ``torch.distributed._composable.checkpoint(module)``) runs its region's ops
under saved-tensor hooks that ``torch.utils.checkpoint`` defines: the hooks on top of the
autograd engine's default hook stack (``torch._C._autograd._top_saved_tensors_default_hooks``,
private) tell. Reentrant checkpointing runs its region inside a function of
``torch/utils/checkpoint.py`` (``CheckpointFunction.forward``): such a frame on the call stack
tells.
`in_activation_checkpoint` asks both; `checkpointing` walks the frames only without grad.

A non-reentrant region's state is a ``_CheckpointFrame`` that its pack hook closes over
(private): `checkpoint_frame` finds it for the running op, `preserves_rng` reads its
``preserve_rng_state``, and `around_recomputation` makes the region's recomputation in backward
(``frame.recompute_fn``, private) run inside a function of the caller's (the plan executor
replays the region's nodes there); `saved_count` / `stops_early` read how many tensors it
saved and whether its recomputation stops after the last of them (the capture notes where).
`nested_checkpoint`: a region inside another. A reentrant region's autograd context is the
``ctx`` of ``CheckpointFunction.forward`` (`reentrant_context`, a frame's locals);
`around_rerun` wraps its ``run_function``, which its backward calls again;
`in_reentrant_backward`: that backward (``CheckpointFunction.backward``) is running.
`checkpoint_region` finds either kind of region (in its forward) and
`around_region_recomputation` wraps its recomputation, whichever kind it is;
`recompute_draws_alike` has a region's recomputation draw from a private ``torch.Generator``
(not one of the global generators torch's checkpoint puts back) what its forward drew.

`packing_around`: the pack hook on top of that stack (a recomputation's: torch's own, which
detaches each tensor an op saves) runs inside a function of the caller's for a while (the plan
executor runs its ops unmatched: they are no ops of the network's).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint_module

_CHECKPOINT = "torch.utils.checkpoint"
_REENTRANT_FORWARD = _checkpoint_module.CheckpointFunction.forward.__code__
_REENTRANT_BACKWARD = _checkpoint_module.CheckpointFunction.backward.__code__
_CHECKPOINT_CALL = inspect.unwrap(_checkpoint_module.checkpoint).__code__


def in_activation_checkpoint() -> bool:
    """Whether the running code is inside an activation-checkpointed region.

    Example:
        >>> with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        ...     in_activation_checkpoint()
        False
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is not None and getattr(top[0], "__module__", "") == _CHECKPOINT:
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:  # (not ``checkpoint_sequential``'s last
            return True  # segment, which runs plainly in a function of that file)
        frame = frame.f_back  # type: ignore[assignment]
    return False


def checkpointing() -> bool:
    """`in_activation_checkpoint`, cheap where grad mode is on (about 100 ns: the
    plan executor asks on its ops): a reentrant region's forward runs without grad, so only
    then are the frames walked.

    Example:
        >>> checkpointing()
        False
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is not None and getattr(top[0], "__module__", "") == _CHECKPOINT:
        return True
    return not torch.is_grad_enabled() and in_activation_checkpoint()


def checkpoint_frame() -> Any | None:
    """The ``_CheckpointFrame`` of the non-reentrant checkpoint region the running op is in
    (its forward; not its recomputation), or None (no region, a reentrant one).

    Example:
        >>> checkpoint_frame() is None
        True
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    pack = top[0] if top is not None else None
    code = getattr(pack, "__code__", None)
    if code is None or not getattr(pack, "__qualname__", "").startswith("_checkpoint_hook."):
        return None
    if "frame" not in code.co_freevars or pack.__closure__ is None:
        return None
    return pack.__closure__[code.co_freevars.index("frame")].cell_contents


def reentrant_context() -> Any | None:
    """The autograd context of the reentrant checkpoint region the running op is in (the
    ``ctx`` of the private ``CheckpointFunction.forward`` on the call stack, whose
    ``run_function`` backward calls again), or None.

    Example:
        >>> reentrant_context() is None
        True
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return frame.f_locals.get("ctx")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def in_reentrant_backward() -> bool:
    """Whether the running code is inside a reentrant region's backward (the private
    ``CheckpointFunction.backward`` on the call stack: its recomputation and the backward of
    its own it runs inside the enclosing one).

    Example:
        >>> in_reentrant_backward()
        False
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_BACKWARD:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def around_rerun(ctx: Any, around: Callable[[Callable[[], None]], None]) -> None:
    """Make a reentrant region's recomputation in backward (``ctx.run_function``, called by
    ``CheckpointFunction.backward`` with the RNG state and autocast restored) run as
    ``around(run)``; its outputs are returned as the region's function returns them.

    Example:
        >>> around_rerun(ctx, lambda run: run())  # doctest: +SKIP
    """
    own = ctx.run_function

    def rerun(*args: Any) -> Any:
        out: list[Any] = []
        around(lambda: out.append(own(*args)))
        return out[0]

    ctx.run_function = rerun


def checkpoint_calls() -> int:
    """How many ``torch.utils.checkpoint.checkpoint`` calls the running code is inside (their
    frames on the call stack; 2: a checkpointed region inside another).

    Example:
        >>> checkpoint_calls()
        0
    """
    frame, calls = sys._getframe(1), 0
    while frame is not None:
        calls += frame.f_code is _CHECKPOINT_CALL
        frame = frame.f_back  # type: ignore[assignment]
    return calls


def nested_checkpoint() -> bool:
    """Whether the running code is inside a checkpointed region inside another.

    Example:
        >>> nested_checkpoint()
        False
    """
    return checkpoint_calls() > 1


def preserves_rng(frame: Any) -> bool:
    """Whether `frame`'s recomputation restores the random generators' state
    (``preserve_rng_state``, a variable its private ``recompute_fn`` closes over)."""
    fn = frame.recompute_fn
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    if "preserve_rng_state" not in names or fn.__closure__ is None:
        return True
    return bool(fn.__closure__[names.index("preserve_rng_state")].cell_contents)


def saved_count(frame: Any) -> int:
    """How many tensors the ops of non-reentrant region `frame` saved for backward so far (its
    private ``weak_holders``: one per saved tensor; an early-stopping recomputation ends once
    it has saved as many again).

    Example:
        >>> saved_count(frame)  # doctest: +SKIP
        3
    """
    return len(frame.weak_holders)


def stops_early(frame: Any) -> bool:
    """Whether `frame`'s recomputation stops once it has recomputed every saved tensor (its
    private ``early_stop``: torch's default, ``set_checkpoint_early_stop(False)`` turns it off).

    Example:
        >>> stops_early(frame)  # doctest: +SKIP
        True
    """
    return bool(frame.early_stop)


def around_recomputation(frame: Any, around: Callable[[Callable[[], None]], None]) -> None:
    """Make `frame`'s recomputation in backward run as ``around(run)``, where ``run()`` is
    torch's own recomputation (RNG state and autocast restored, the region's function called).

    Example:
        >>> around_recomputation(frame, lambda run: run())  # doctest: +SKIP
    """
    own = frame.recompute_fn

    def recompute(*args: Any) -> None:
        around(lambda: own(*args))

    frame.recompute_fn = recompute


def checkpoint_region() -> tuple[Any, bool] | None:
    """The checkpointed region the running op is in, while the region's forward runs (not its
    recomputation): a non-reentrant region's ``_CheckpointFrame`` or a reentrant one's
    autograd context, and whether its recomputation restores the random generators' state
    (``preserve_rng_state``); None outside any. The call stack is walked only without grad
    (a reentrant region's forward runs without it).

    Example:
        >>> checkpoint_region() is None
        True
    """
    frame = checkpoint_frame()
    if frame is not None:
        return frame, preserves_rng(frame)
    if torch.is_grad_enabled():
        return None
    ctx = reentrant_context()
    if ctx is None:
        return None
    return ctx, bool(getattr(ctx, "preserve_rng_state", True))


def around_region_recomputation(region: Any, around: Callable[[Callable[[], None]], None]) -> None:
    """Make the recomputation of `region` (`checkpoint_region`'s: a frame or a reentrant
    context) run as ``around(run)`` (`around_recomputation` / `around_rerun`)."""
    if hasattr(region, "recompute_fn"):
        around_recomputation(region, around)
    else:
        around_rerun(region, around)


_NOTED: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
"""Per checkpointed region (alive until its backward ends): the ids of the private generators
`recompute_draws_alike` noted in it."""


def recompute_draws_alike(gen: torch.Generator) -> None:
    """Make the recomputation of the checkpointed region the running op is in draw from `gen`
    what the region's forward draws from it (call right before each draw from `gen`).

    At the region's first draw from `gen` its state is noted; the recomputation runs with that
    state put back and leaves `gen` as it found it (as torch does for the global generators).
    Nothing outside a region, and for a region with ``preserve_rng_state=False`` (whose
    recomputation draws anew).

    Example:
        >>> gen = torch.Generator()
        >>> recompute_draws_alike(gen)  # (outside any region: nothing)
    """
    found = checkpoint_region()
    if found is None or not found[1]:
        return
    region = found[0]
    noted = _NOTED.setdefault(region, set())
    if id(gen) in noted:
        return
    noted.add(id(gen))
    state = gen.get_state()

    def around(run: Callable[[], None]) -> None:
        now = gen.get_state()
        gen.set_state(state)
        try:
            run()
        finally:
            gen.set_state(now)

    around_region_recomputation(region, around)


@contextlib.contextmanager
def packing_around(around: Callable[[Callable[[], Any]], Any]) -> Iterator[None]:
    """While the block runs, the pack hook on top of the autograd engine's saved-tensor hook
    stack (if any) runs as ``around(pack)``: ``around`` calls ``pack()`` and returns what it
    returns. The wrapper keeps the hook's name and module (`checkpointing` still tells); the
    unpack hook, which backward runs later, is kept as it is.

    Example:
        >>> with packing_around(lambda pack: pack()):
        ...     pass
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is None:
        yield
        return
    pack, unpack = top

    @functools.wraps(pack)
    def packed(tensor: torch.Tensor) -> Any:
        return around(lambda: pack(tensor))

    with torch.autograd.graph.saved_tensors_hooks(packed, unpack):
        yield


__all__ = [
    "around_recomputation",
    "around_region_recomputation",
    "around_rerun",
    "checkpoint_frame",
    "checkpoint_region",
    "checkpointing",
    "in_activation_checkpoint",
    "in_reentrant_backward",
    "nested_checkpoint",
    "packing_around",
    "preserves_rng",
    "recompute_draws_alike",
    "reentrant_context",
    "saved_count",
    "stops_early",
]
