"""Whether an op runs inside activation checkpointing (``torch.utils.checkpoint``).

Non-reentrant checkpointing (``checkpoint(fn, use_reentrant=False)``, ``checkpoint_wrapper``,
the composable ``torch.distributed._composable.checkpoint(module)``) runs its region's ops
under saved-tensor hooks that ``torch.utils.checkpoint`` defines: the hooks on top of the
autograd engine's default hook stack (``torch._C._autograd._top_saved_tensors_default_hooks``,
private) tell. Reentrant checkpointing runs its region inside a function of
``torch/utils/checkpoint.py``: a frame of that file on the call stack tells.
`in_activation_checkpoint` asks both; `checkpointing` walks the frames only without grad.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_CHECKPOINT = "torch.utils.checkpoint"
_CHECKPOINT_FILE = str(Path(torch.__file__).parent / "utils" / "checkpoint.py")


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
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            return True
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


__all__ = ["checkpointing", "in_activation_checkpoint"]
