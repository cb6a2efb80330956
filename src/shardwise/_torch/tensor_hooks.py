"""A tensor's backward hooks (``Tensor._backward_hooks``), attached again to its autograd data.

``Tensor.register_hook`` keeps a tensor's hooks in one dict, handed to autograd the first time
(only then). ``Module.to(dtype)`` / ``.half()`` swap a parameter's contents
(``torch.utils.swap_tensors``) when the parameter is a traceable wrapper subclass (a simulated
world's ``LocalTensor``) or under ``torch.__future__.set_swap_module_params_on_conversion(True)``:
the Python object keeps its dict, but autograd's copy went with the swapped-out contents, so no
hook registered before or after runs again. The gradient buckets (`parallel/_grad_plan.py`)
hand the dict to autograd again after such a change.
"""

from __future__ import annotations

import torch


def reattach_hooks(tensor: torch.Tensor) -> None:
    """Hand `tensor`'s backward hook dict to autograd again (replacing what autograd holds for
    it: the same dict when nothing was swapped); nothing when it has none."""
    hooks = tensor._backward_hooks
    if hooks is not None:
        tensor._backward_hooks = hooks
