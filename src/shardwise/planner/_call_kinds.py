"""How capture and the plan executor treat a torch-level call (`record_kind`), and what a
differentiation call asks for (`creates_graph`, `keeps_graph`: ``torch.autograd.grad`` ends a
train step's graph only when it frees it; `call_name`: a call's name as nodes carry it;
`grad_inputs`: the tensors it differentiates with
respect to; `seeds_of` / `with_seeds`: the tensors it starts from and their gradients, read
and replaced; `resets_each_element`: a call that changes each element of its first argument
on its own, as ``zero_grad(set_to_none=False)`` does to a ``.grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import resolve_name

from shardwise._torch.dispatch import OpOverload, OpOverloadPacket, TensorBase

T = torch.Tensor
_METADATA = {T.size, T.dim, T.ndimension, T.is_contiguous, T.is_floating_point, T.numel}
_METADATA |= {T.stride, T.element_size, T.nelement, T.data_ptr, T.__len__, T.get_device}
_METADATA |= {T.untyped_storage, T.storage_offset}  # (where the data lives: no value read)
_VALUE_READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.numpy}
_VALUE_READS |= {T.__format__, T.__repr__, T.__str__}


# attributes that are ops, each a node (``x.T``; ``x.data``: ``detach``'s program; ``z.real``:
# ``view_as_real`` and ``select``); other getters (``x.grad``, ``x.shape``) and every setter
# (``p.data = v``) are no node
_ATTR_OPS = {"T", "mT", "H", "mH", "data", "real", "imag"}
_ALIASES = {TensorBase.contiguous, T.contiguous}  # the same value, no node


def record_kind(func: Callable[..., Any]) -> str:
    """How capture (and the plan executor) treat a torch-level call: ``"skip"`` (metadata,
    attribute reads and writes but the reads of `_ATTR_OPS`), ``"read"`` (a tensor's value),
    ``"backward"`` (the end of a train step's graph), ``"grad"`` (``torch.autograd.grad``: run,
    no node) or ``"op"`` (a node of the graph), ``"alias"`` (returns its input's value:
    ``contiguous``)."""
    if func in _ALIASES:
        return "alias"
    if func in _METADATA or _namespace(func) == "prim":
        return "skip"  # (``torch.ops.prim.device`` and kin: metadata; ``torch.ops.aten.*``: ops)
    if func is T.backward or func is torch.autograd.backward:
        return "backward"
    if func is torch.autograd.grad:
        return "grad"
    if func in _VALUE_READS:
        return "read"
    if getattr(func, "__name__", "") in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        is_op = func.__name__ == "__get__" and getattr(owner, "__name__", "") in _ATTR_OPS
        return "op" if is_op else "skip"
    return "op"


_SIZE_READS = {T.size, T.__len__, T.numel, T.nelement}


def reads_size(func: Callable[..., Any]) -> bool:
    """Whether a torch-level call reads a tensor's shape (``x.shape``, ``x.size(0)``,
    ``len(x)``, ``x.numel()``)."""
    if func in _SIZE_READS:
        return True
    owner = getattr(func, "__self__", None)
    return getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", "") == "shape"


def _namespace(func: Any) -> str | None:
    """A ``torch.ops`` op's namespace (``"aten"``, ``"prim"``), an overload's or a packet's
    (``torch.ops.prim.device`` and ``torch.ops.prim.device.default`` alike); None for others."""
    if isinstance(func, OpOverload):
        return str(func.namespace)
    if isinstance(func, OpOverloadPacket):
        return str(func).split(".", 1)[0]
    return None


def creates_graph(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a ``backward`` / ``torch.autograd.grad`` call passes ``create_graph=True``."""
    at = 4 if func is torch.autograd.grad else 3  # (its place among the positional ones)
    return bool(kwargs.get("create_graph", args[at] if len(args) > at else False))


def keeps_graph(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a ``torch.autograd.grad(*args, **kwargs)`` call keeps the graph (its
    ``retain_graph``, by default its ``create_graph``): a gradient taken mid-step, not the
    step's last differentiation."""
    retain = kwargs.get("retain_graph", args[3] if len(args) > 3 else None)
    return bool(retain if retain is not None else creates_graph(torch.autograd.grad, args, kwargs))


def call_name(func: Callable[..., Any]) -> str:
    """A torch-level call's qualified name, as the capture records it (``torch.Tensor.view``,
    ``torch.nn.functional.linear``; a callable torch does not name: its ``__qualname__``)."""
    return str(resolve_name(func) or getattr(func, "__qualname__", repr(func)))


def grad_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The tensors a ``torch.autograd.grad(*args, **kwargs)`` call differentiates with respect
    to (its ``inputs``), in order."""
    given = args[1] if len(args) > 1 else kwargs.get("inputs")
    return list(given) if isinstance(given, list | tuple) else [given]


# where a differentiation call takes its roots and their gradients: (position, keyword) of each
_SEEDS: dict[Any, tuple[int, str, int, str]] = {
    T.backward: (0, "self", 1, "gradient"),
    torch.autograd.backward: (0, "tensors", 1, "grad_tensors"),
    torch.autograd.grad: (0, "outputs", 2, "grad_outputs"),
}


def seeds_of(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The roots a ``backward`` / ``torch.autograd.backward`` / ``torch.autograd.grad`` call
    differentiates and the gradient given for each (None: none given)."""
    r_at, r_key, g_at, g_key = _SEEDS[func]
    roots = args[r_at] if len(args) > r_at else kwargs.get(r_key)
    grads = args[g_at] if len(args) > g_at else kwargs.get(g_key)
    roots_list = [roots] if not isinstance(roots, list | tuple) else list(roots)
    if grads is None:
        return roots_list, [None] * len(roots_list)
    return roots_list, [grads] if not isinstance(grads, list | tuple) else list(grads)


def with_seeds(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grads: list[Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with `grads` as the roots' gradients (`seeds_of`'s order)."""
    _, _, g_at, g_key = _SEEDS[func]
    value: Any = grads[0] if func is T.backward else tuple(grads)
    if len(args) > g_at:
        return (*args[:g_at], value, *args[g_at + 1 :]), kwargs
    return args, {**kwargs, g_key: value}


GRAD_RESETS = frozenset(
    f"torch.Tensor.{m}" for m in ("zero_", "fill_", "mul_", "div_", "requires_grad_", "detach_")
)
"""Calls on a parameter's ``.grad`` before the forward that are no node (`resets_each_element`):
``module.zero_grad(set_to_none=False)`` (``requires_grad_`` / ``detach_``, ``zero_``), a fill
or a scaling by a number."""


def resets_each_element(op: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether call `op` (`call_name`) changes each element of its first argument on its own
    (`GRAD_RESETS`, given no other tensor): on a split gradient each rank's block or shard
    takes it as the whole gradient would. A reduction (``p.grad.norm()``) or an op mixing
    another tensor in is not one."""
    if op not in GRAD_RESETS:
        return False
    return not any(isinstance(a, T) for a in args[1:]) and not any(
        isinstance(v, T) for v in kwargs.values()
    )
