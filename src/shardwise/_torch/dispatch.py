"""The dispatcher's Python types that capture and the plan executor recognise.

- `TorchDispatchMode`: the base of capture's aten-level recorder (`planner/_recorders.py`),
  which sees every aten op a torch-level call runs; only in ``torch.utils._python_dispatch``.
- `OpOverload`, `OpOverloadPacket`: the types of ``torch.ops.aten.*`` objects; a torch-level
  call of one (a dispatch mode calling aten from Python) is not a node of its own.
- `TensorBase`: the C++ tensor base class, whose ``contiguous`` a torch-function mode receives
  as well as ``Tensor.contiguous``.
- `argument_names`: an aten op's parameter names, from its schema (``OpOverload._schema``).
"""

from __future__ import annotations

from torch._C import TensorBase
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode


def argument_names(op: OpOverload) -> tuple[str, ...]:
    """The names of `op`'s parameters, in order (``aten.native_dropout.default``: ``("input",
    "p", "train")``)."""
    return tuple(a.name for a in op._schema.arguments)


__all__ = ["OpOverload", "OpOverloadPacket", "TensorBase", "TorchDispatchMode", "argument_names"]
