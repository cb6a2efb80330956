"""Whether a ``torch.func`` (functorch) transform is running, and which.

The capture refuses calls made inside ``torch.func.vmap`` / ``grad`` / ``jacrev`` / ``jvp`` /
``functionalize``: a plan's ops are torch calls on whole tensors, and a transform's calls are
on batched or wrapped ones. torch has no public way to ask whether one is active; functorch's
own interpreter stack says it (``torch._C._functorch.maybe_current_level``, and the
interpreter on top of it, ``retrieve_current_functorch_interpreter().key()``).
"""

from __future__ import annotations

import torch
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

_PUBLIC_NAMES = {
    "Vmap": "torch.func.vmap",
    "Grad": "torch.func.grad / vjp / jacrev",
    "Jvp": "torch.func.jvp / jacfwd",
    "Functionalize": "torch.func.functionalize",
}


def current_transform() -> str | None:
    """The innermost running functorch transform, by the ``torch.func`` functions that make it
    (``"torch.func.vmap"``), or None when none runs."""
    if torch._C._functorch.maybe_current_level() is None:
        return None
    name = retrieve_current_functorch_interpreter().key().name
    return _PUBLIC_NAMES.get(name, f"torch.func ({name})")
