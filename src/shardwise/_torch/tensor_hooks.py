"""A tensor's backward hooks (``Tensor._backward_hooks``), attached again to its autograd data.

``Tensor.register_hook`` keeps a tensor's hooks in one dict, handed to autograd the first time
(only then). ``Module.to(dtype)`` / ``.half()`` swap a parameter's contents
(``torch.utils.swap_tensors``) when the parameter is a traceable wrapper subclass (a simulated
world's ``LocalTensor``) or under ``torch.__future__.set_swap_module_params_on_conversion(True)``:
the Python object keeps its dict, but autograd's copy went with the swapped-out contents, so no
hook registered before or after runs again, even when nothing changed (``net.float()`` on a
float32 network). The gradient buckets (`parallel/_grad_plan.py`) hand the dict to autograd
again at each call for the parameters such a conversion swaps (`swapped_on_conversion`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def reattach_hooks(tensor: torch.Tensor) -> None:
    """Hand `tensor`'s backward hook dict to autograd again (replacing what autograd holds for
    it: the same dict when nothing was swapped); nothing when it has none."""
    hooks = tensor._backward_hooks
    if hooks is not None:
        tensor._backward_hooks = hooks


def swapped_on_conversion(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Those of `params` whose contents ``Module.to`` / ``.float()`` would swap (every one under
    ``torch.__future__.set_swap_module_params_on_conversion(True)``, else the traceable wrapper
    subclasses): their hooks may need `reattach_hooks` after any conversion."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return list(params)
    plain = torch.nn.Parameter
    return [p for p in params if type(p) is not plain and is_traceable_wrapper_subclass(p)]
