"""Image transforms with MindSpore's ``mindspore.dataset.vision`` semantics, on torch tensors.

- `Rescale`: ``x * rescale + shift`` as float32.
- `Normalize`: ``(x - mean[c]) / std[c]`` per channel, HWC (default) or CHW, as float32.
- `HWC2CHW`: move the channel axis first; a 2-D ``<H, W>`` image stays unchanged.

Each is a `transforms.Transform`: ``op(image)`` transforms one image, and the pipeline calls
``op.apply_batch(images)`` on a stack of images so that a ``map`` before ``batch`` costs one
vectorized call per batch instead of one per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.dataset._args import check_flag
from shardwise.dataset.transforms import Transform

__all__ = ["HWC2CHW", "Normalize", "Rescale"]


def _number(value: object, who: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{who}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def _image_ndim(x: torch.Tensor, batched: bool, who: str) -> int:
    """Number of dims of one image, checking that it is ``<H, W>`` or ``<H, W, C>``-like."""
    ndim = x.dim() - 1 if batched else x.dim()
    if ndim not in (2, 3):
        what = "a stack of images <N, H, W[, C]>" if batched else "an image <H, W> or <H, W, C>"
        raise ValueError(f"{who}: expected {what}, got shape {list(x.shape)}")
    return ndim


class Rescale(Transform):
    """``output = image * rescale + shift``, computed and returned as float32.

    Args:
        rescale: the scale factor, e.g. ``1.0 / 255.0``.
        shift: the offset added after scaling.

    Raises:
        TypeError: `rescale` or `shift` is not a number.

    Example:
        >>> Rescale(1.0 / 255.0, 0)(torch.tensor([[0, 255]], dtype=torch.uint8))
        tensor([[0., 1.]])
    """

    def __init__(self, rescale: float, shift: float) -> None:
        self.rescale = _number(rescale, "Rescale", "rescale")
        self.shift = _number(shift, "Rescale", "shift")

    def _apply(self, x: torch.Tensor, batched: bool) -> torch.Tensor:
        return x.to(torch.float32).mul(self.rescale).add(self.shift)


def _channels(
    values: Sequence[float], who: str, name: str, low: float, strict: bool
) -> list[float]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(f"{who}: {name} must be a list or tuple of numbers, one per channel")
    out = [_number(v, who, name) for v in values]
    if not out:
        raise ValueError(f"{who}: {name} is empty; give one value per channel")
    for v in out:
        if v > 255.0 or v < low or (strict and v == low):
            bound = "(0.0, 255.0]" if strict else "[0.0, 255.0]"
            raise ValueError(f"{who}: every {name} value must lie in {bound}, got {v}")
    return out


class Normalize(Transform):
    """``output[c] = (image[c] - mean[c]) / std[c]`` per channel, returned as float32.

    Args:
        mean: one mean per channel, each in [0, 255] (``(0.1307,)`` after ``Rescale(1/255)``).
        std: one standard deviation per channel, each in (0, 255].
        is_hwc: True when the channel is the last axis (``<H, W, C>``), False for ``<C, H, W>``.
            A 2-D ``<H, W>`` image counts as one channel.

    Raises:
        TypeError: `mean` or `std` is not a sequence of numbers.
        ValueError: a value out of range, or `mean` and `std` of different lengths; at call
            time, a channel count that matches neither ``len(mean)`` nor 1.

    Example:
        >>> Normalize(mean=(0.5,), std=(0.25,))(torch.ones(2, 2, 1))
        tensor([[[2.], [2.]], [[2.], [2.]]])
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], is_hwc: bool = True) -> None:
        self.mean = _channels(mean, "Normalize", "mean", 0.0, strict=False)
        self.std = _channels(std, "Normalize", "std", 0.0, strict=True)
        if len(self.mean) != len(self.std):
            raise ValueError(
                f"Normalize: mean has {len(self.mean)} values but std has {len(self.std)}; "
                "give one of each per channel"
            )
        self.is_hwc = check_flag(is_hwc, "Normalize", "is_hwc")

    def _apply(self, x: torch.Tensor, batched: bool) -> torch.Tensor:
        ndim = _image_ndim(x, batched, "Normalize")
        mean = torch.tensor(self.mean, dtype=torch.float32)
        std = torch.tensor(self.std, dtype=torch.float32)
        if ndim == 3:
            channels = x.shape[-1] if self.is_hwc else x.shape[-3]
            if len(self.mean) not in (1, channels):
                raise ValueError(
                    f"Normalize: the image has {channels} channels (shape {list(x.shape)}, "
                    f"is_hwc={self.is_hwc}) but mean/std have {len(self.mean)} values"
                )
            if not self.is_hwc:
                mean, std = mean.view(-1, 1, 1), std.view(-1, 1, 1)
        elif len(self.mean) != 1:
            raise ValueError(
                f"Normalize: a 2-D image has one channel but mean/std have {len(self.mean)} values"
            )
        return (x.to(torch.float32) - mean) / std


class HWC2CHW(Transform):
    """Transpose an image from ``<H, W, C>`` to ``<C, H, W>``; ``<H, W>`` stays unchanged.

    Raises:
        ValueError: at call time, an image that is neither 2-D nor 3-D.

    Example:
        >>> HWC2CHW()(torch.zeros(28, 28, 1)).shape
        torch.Size([1, 28, 28])
    """

    def _apply(self, x: torch.Tensor, batched: bool) -> torch.Tensor:
        if _image_ndim(x, batched, "HWC2CHW") == 2:
            return x
        return x.movedim(-1, -3).contiguous()
