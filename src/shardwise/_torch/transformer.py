"""``nn.TransformerEncoder``'s nested-tensor fast path: the undocumented parts of torch's
forward that decide on it, read by `parallel/_nested_encoders` (which replays the path with
public ops).

- `canonical_masks(src, mask, padding)`: the masks the forward works with (``F._canonical_mask``:
  a bool mask becomes ``-inf`` where True and 0 elsewhere, in ``src``'s dtype);
- `fast_path_devices()`: the device types the fast path runs on;
- `nested_enabled(encoder)`: its ``use_nested_tensor`` (set in ``__init__`` from
  ``enable_nested_tensor`` and whether the layer fits), `mask_checked(encoder)`: its
  ``mask_check`` (whether the padding's left alignment is checked).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def canonical_masks(
    src: torch.Tensor, mask: torch.Tensor | None, padding: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(mask, src_key_padding_mask)`` as ``nn.TransformerEncoder.forward`` makes them."""
    padding = F._canonical_mask(
        mask=padding,
        mask_name="src_key_padding_mask",
        other_type=F._none_or_dtype(mask),
        other_name="mask",
        target_type=src.dtype,
    )
    mask = F._canonical_mask(
        mask=mask,
        mask_name="mask",
        other_type=None,
        other_name="",
        target_type=src.dtype,
        check_other=False,
    )
    return mask, padding


def fast_path_devices() -> tuple[str, ...]:
    """The device types of ``src`` the fast path takes."""
    return ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)


def nested_enabled(encoder: nn.TransformerEncoder) -> bool:
    """Whether `encoder` may make nested tensors (``use_nested_tensor``)."""
    return bool(getattr(encoder, "use_nested_tensor", False))


def mask_checked(encoder: nn.TransformerEncoder) -> bool:
    """Whether `encoder` checks that the padding is left aligned (``mask_check``)."""
    return bool(getattr(encoder, "mask_check", True))
