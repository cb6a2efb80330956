"""The dispatcher's Python types that capture and the plan executor recognise.

- `TorchDispatchMode`: the base of capture's aten-level recorder (`planner/_recorders.py`),
  which sees every aten op a torch-level call runs; only in ``torch.utils._python_dispatch``.
- `OpOverload`, `OpOverloadPacket`: the types of ``torch.ops.aten.*`` objects; a torch-level
  call of one (a dispatch mode calling aten from Python) is not a node of its own.
- `TensorBase`: the C++ tensor base class, whose ``contiguous`` a torch-function mode receives
  as well as ``Tensor.contiguous``.
- `argument_names`: an aten op's parameter names, from its schema (``OpOverload._schema``).
- `returned_aliases`: per return of an aten op, the arguments whose storage it shares, from
  its schema's alias annotations (``t(Tensor(a) self) -> Tensor(a)``).
"""

from __future__ import annotations

from torch._C import TensorBase
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode


def argument_names(op: OpOverload) -> tuple[str, ...]:
    """The names of `op`'s parameters, in order (``aten.native_dropout.default``: ``("input",
    "p", "train")``)."""
    return tuple(a.name for a in op._schema.arguments)


def returned_aliases(op: OpOverload) -> tuple[tuple[int, ...], ...]:
    """Per return of `op`, the positions of the arguments whose storage it shares, read from
    the alias annotations of its schema: a return ``Tensor(a)`` shares an argument
    ``Tensor(a)`` (a view, ``(a!)`` an in-place op's output), a list ``Tensor(a)[]`` shares
    the arguments whose alias set flows into it (``Tensor(a -> *)``).

    Example:
        >>> returned_aliases(torch.ops.aten.t.default), returned_aliases(torch.ops.aten.add.Tensor)
        (((0,),), ((),))
        >>> returned_aliases(torch.ops.aten.split.Tensor)
        ((0,),)
    """
    schema = op._schema
    out = []
    for ret in schema.returns:
        shared = []
        for at, arg in enumerate(schema.arguments):
            if ret.alias_info is None or arg.alias_info is None:
                continue
            same = set(ret.alias_info.before_set) & set(arg.alias_info.before_set)
            listed = not ret.alias_info.before_set and "*" in arg.alias_info.after_set
            if same or listed:
                shared.append(at)
        out.append(tuple(shared))
    return tuple(out)


__all__ = [
    "OpOverload",
    "OpOverloadPacket",
    "TensorBase",
    "TorchDispatchMode",
    "argument_names",
    "returned_aliases",
]
