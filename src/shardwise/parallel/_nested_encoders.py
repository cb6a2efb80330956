"""torch's ``nn.TransformerEncoder`` fast path, its result replayed by the capture and the run
(`nested_encoders`).

On one device an encoder in eval mode, given a ``src_key_padding_mask`` and no ``mask``, with
``enable_nested_tensor=True`` (torch's default), without autograd to record and without
autocast, packs its input into a nested tensor of the unpadded tokens, runs its layers on it
and pads the result with zeros: its output at padded positions is 0 (before its ``norm``). The
capture and the run call torch on fake or wrapped tensors under a torch-function mode, which
torch's check (``has_torch_function``) turns away from that path, so their result kept the
ordinary path's values there. Inside `nested_encoders` such a call runs the ordinary path with
the padding as torch's nested tensor reads it (a key is kept where its mask is 0) and zeroes the
padded positions of the layers' output, with ops the plan carries out like any other: one
device's result in every mode. torch packs only a padding that is left aligned on every row
(each row's kept tokens first) when ``mask_check`` is on (the default); otherwise the ordinary
path runs, so the zeroing is conditioned on that, computed over the whole batch. With
``mask_check=False`` torch packs each row's first ``n`` tokens, ``n`` its kept ones; so does the
replay. Any other call runs torch's forward as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardwise._torch.transformer import (
    canonical_masks,
    fast_path_devices,
    mask_checked,
    nested_enabled,
)

_TORCH_FORWARD = nn.TransformerEncoder.forward


def _takes_nested_path(
    encoder: nn.TransformerEncoder,
    src: torch.Tensor,
    mask: torch.Tensor | None,
    padding: torch.Tensor | None,
) -> bool:
    """Whether one device's call would pack `src` into a nested tensor (torch's conditions but
    the padding's alignment, a value, and ``has_torch_function``)."""
    first = encoder.layers[0]
    if not (torch.backends.mha.get_fastpath_enabled() and nested_enabled(encoder)):
        return False
    if first.training or src.dim() != 3 or padding is None or mask is not None:
        return False
    if src.is_nested or torch.is_autocast_enabled() or not first.self_attn.batch_first:
        return False
    if mask_checked(encoder) and torch.compiler.is_compiling():
        return False
    if src.device.type not in fast_path_devices():
        return False
    attn = first.self_attn
    weights = [attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias]
    for m in (first.norm1, first.norm2, first.linear1, first.linear2):
        weights += [m.weight, m.bias]
    tracked = [src, *(w for w in weights if w is not None)]
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tracked))


def _padded_forward(
    encoder: nn.TransformerEncoder,
    src: torch.Tensor,
    mask: torch.Tensor | None = None,
    src_key_padding_mask: torch.Tensor | None = None,
    is_causal: bool | None = None,
) -> torch.Tensor:
    """``nn.TransformerEncoder.forward`` with its nested path's result (module docstring)."""
    canon_mask, padding = canonical_masks(src, mask, src_key_padding_mask)
    if padding is None or not _takes_nested_path(encoder, src, canon_mask, padding):
        return _TORCH_FORWARD(encoder, src, mask, src_key_padding_mask, is_causal)
    kept = padding == 0  # ([B, T]: the tokens the nested tensor holds)
    if mask_checked(encoder):  # (packed only if every row's kept tokens come first)
        dropped = ~kept
        packed = ~(kept[:, 1:] & ~kept[:, :-1]).any()
    else:  # (packed as each row's first n tokens, n its kept ones)
        positions = torch.arange(src.size(1), device=src.device)
        dropped = positions >= kept.sum(1, keepdim=True)
        packed = torch.ones((), dtype=torch.bool, device=src.device)
    as_packed = torch.zeros_like(padding).masked_fill(dropped, float("-inf"))
    layer_padding = torch.where(packed, as_packed, padding)
    out = src
    for layer in encoder.layers:  # (the fast layer ignores is_causal without a mask)
        out = layer(out, src_mask=None, is_causal=False, src_key_padding_mask=layer_padding)
    out = out.masked_fill((dropped & packed).unsqueeze(-1), 0.0)
    if encoder.norm is not None:
        out = encoder.norm(out)
    return out


@contextmanager
def nested_encoders() -> Iterator[None]:
    """While the block runs, every ``nn.TransformerEncoder`` call gives one device's result
    where one device takes torch's nested-tensor path (module docstring).

    Example:
        >>> with nested_encoders():  # doctest: +SKIP
        ...     out = encoder(x, src_key_padding_mask=pad)
    """
    if nn.TransformerEncoder.forward is not _TORCH_FORWARD:  # (inside such a block, or replaced)
        yield
        return
    nn.TransformerEncoder.forward = _padded_forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.TransformerEncoder.forward = _TORCH_FORWARD  # type: ignore[method-assign]
