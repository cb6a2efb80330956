"""The torch-function mode that records construction inside ``no_init_parameters``.

While the mode is active:

1. a tensor factory (``torch.empty``, ``torch.randn``, ``torch.tensor`` ...) without an
   explicit ``device="meta"`` creates a meta tensor instead; the call is recorded with the
   device and dtype it would have used (`Recorder._factory`). An empty result of a factory
   that draws nothing (``torch.tensor([])``) is made for real on that device instead;
2. a call that touches deferred tensors is run on meta and recorded when it mutates one
   (in-place methods, ``nn.init.*_``, ``__setitem__``, ``out=``) or creates a new tensor
   from them (``new_empty``, ``.to(...)``, arithmetic) (`Recorder._operation`); pure
   views and queries (``w[0]``, ``w.t()``, ``w.size()``) are not recorded, because every
   reference already names its storage, offset and strides;
3. ``.to(device)`` / ``.cuda()`` / ``.cpu()`` and ``device=`` arguments on deferred tensors
   stay on meta and remember the requested device (`_retarget`);
4. ``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_``, which
   silently do nothing on meta tensors, are swapped for overridable wrappers so that they
   are recorded too (`patched_init_functions`).

Nothing is allocated and no random number is drawn; the tape is replayed later, in order,
from the generator state at entry (see ``_replay``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from shardwise.parameter import _rng
from shardwise.parameter._tape import RecordedOp, Session, flatten, iter_tensors

_FACTORIES: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.empty,
        torch.empty_strided,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.normal,
        torch.arange,
        torch.range,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.tensor,
        torch.scalar_tensor,
    }
)
# Factories whose empty result is made for real, on the device asked for: there is nothing to
# allocate or draw, and code that asks where a new tensor lands (``torch.tensor([]).device``:
# Hugging Face's ``PreTrainedModel.init_weights`` skips its initialization when it is meta)
# sees the device the network is built for.
_EMPTY_MADE_REAL: frozenset[Callable[..., Any]] = frozenset(
    {torch.tensor, torch.empty, torch.zeros, torch.ones, torch.full}
)
# In-place by name ("uniform_") but only flags, not values.
_NOT_MUTATING = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream"})
_MUTATING_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)


# Their meta kernels go through torch._refs, whose first use imports torch._dynamo (seconds);
# on meta they only check the dtype, so the recorder does that check itself.
_META_FILLS: tuple[Any, ...] = (torch.Tensor.normal_, torch.nn.init.normal_)
# nn.init functions that return early on meta tensors instead of dispatching.
_META_SKIPPING_INITS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def _overridable(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if torch.overrides.has_torch_function_variadic(tensor):
            return torch.overrides.handle_torch_function(
                wrapper, (tensor,), tensor, *args, **kwargs
            )
        return original(tensor, *args, **kwargs)

    return wrapper


@contextmanager
def patched_init_functions() -> Iterator[None]:
    """Make the meta-skipping ``torch.nn.init`` functions visible to the recorder."""
    originals = {name: getattr(torch.nn.init, name) for name in _META_SKIPPING_INITS}
    for name, original in originals.items():
        setattr(torch.nn.init, name, _overridable(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.nn.init, name, original)


def _is_mutation(func: Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("out") is not None:
        return True
    name = getattr(func, "__name__", "")
    if name in _MUTATING_DUNDERS:
        return True
    return name.endswith("_") and not name.startswith("__") and name not in _NOT_MUTATING


def _requested_device(device: Any) -> torch.device:
    if device is None:
        return _rng.normalize_device(torch.get_default_device())
    return _rng.normalize_device(device)


def _parse_to(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, str | torch.device):
            device = arg
        elif isinstance(arg, torch.Tensor):
            device, dtype = arg.device, arg.dtype
    return device, dtype


Retarget = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], torch.device | None]


def _retarget(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Retarget:
    """What to run on meta instead of a device move, and the device that was asked for."""
    if func is torch.Tensor.to and args:
        device, dtype = _parse_to(args[1:], kwargs)
        if device is not None and torch.device(device).type != "meta":
            self = args[0]
            meta_kwargs = {"dtype": dtype or self.dtype, "copy": True}
            return torch.Tensor.to, (self,), meta_kwargs, _requested_device(device)
    if func is torch.Tensor.cuda and args:
        index = args[1] if len(args) > 1 else kwargs.get("device")
        device = torch.device("cuda", index) if isinstance(index, int) else (index or "cuda")
        return torch.Tensor.clone, (args[0],), {}, _requested_device(device)
    if func is torch.Tensor.cpu and args:
        return torch.Tensor.clone, (args[0],), {}, torch.device("cpu")
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "meta":
        return func, args, {**kwargs, "device": "meta"}, _requested_device(device)
    return func, args, kwargs, None


def _check_fill(tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        dtype = getattr(tensor, "dtype", type(tensor).__name__)
        raise TypeError(f"normal_ needs a floating point tensor, got {dtype}")
    return tensor


class Recorder(TorchFunctionMode):
    """Redirect factories to meta and record what touches deferred tensors into a session."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        call_args = tuple(args)
        call_kwargs = dict(kwargs) if kwargs else {}
        is_factory = func in _FACTORIES and call_kwargs.get("out") is None
        if is_factory and not any(True for _ in iter_tensors(call_args)):
            device = _requested_device(call_kwargs.get("device"))
            if device.type != "meta":
                return self._factory(func, call_args, call_kwargs, device)
        touched = any(self.session.knows(t) for t in iter_tensors((call_args, call_kwargs)))
        if not touched:
            return func(*call_args, **call_kwargs)
        return self._operation(func, call_args, call_kwargs)

    def _factory(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        device: torch.device,
    ) -> Any:
        session = self.session
        meta_kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        out = func(*args, **{**meta_kwargs, "device": "meta"})
        if out.numel() == 0 and func in _EMPTY_MADE_REAL:  # (nothing to allocate or draw)
            return func(*args, **kwargs)
        session.note_device(device)
        session.sync_rng()
        replay_kwargs = {k: v for k, v in kwargs.items() if k != "requires_grad"}
        replay_kwargs["device"] = device
        if replay_kwargs.get("dtype") is None:
            replay_kwargs["dtype"] = out.dtype  # pin today's default dtype
        ref = session.new_root(out, device)
        session.tape.append(RecordedOp(func, args, replay_kwargs, ((0, ref),)))
        return out

    def _operation(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        session = self.session
        encoded_args, encoded_kwargs = session.encode(args), session.encode(kwargs)
        session.sync_rng()
        meta_func, meta_args, meta_kwargs, device = _retarget(func, args, kwargs)
        if func in _META_FILLS:
            out = _check_fill(args[0] if args else kwargs.get("tensor"))
        else:
            out = meta_func(*meta_args, **meta_kwargs)
        new_leaves = [
            (index, leaf)
            for index, leaf in enumerate(flatten(out))
            if isinstance(leaf, torch.Tensor) and leaf.is_meta and not session.knows(leaf)
        ]
        if not new_leaves and not _is_mutation(func, kwargs):
            return out
        if device is None:
            device = session.device_of((args, kwargs))
        else:
            session.note_device(device)
        outputs = tuple((index, session.new_root(leaf, device)) for index, leaf in new_leaves)
        session.tape.append(RecordedOp(func, encoded_args, encoded_kwargs, outputs))
        return out
