"""Data transforms that are not image-specific, and the base class of every built-in transform.

- `Transform`: the base class. A transform is called on one sample (``op(x)``); the pipeline
  may instead call `Transform.apply_batch` on a whole stack of samples (leading batch dim),
  which is how `Dataset.map` stays vectorized before `batch()`.
- `TypeCast`: change a column's dtype (MindSpore's ``transforms.TypeCast``), with `to_dtype`
  turning a torch dtype or a name (``"int32"``, ``"float32"``) into a torch dtype.
"""

from __future__ import annotations

import torch

__all__ = ["Transform", "TypeCast", "to_dtype"]


class Transform:
    """Base class of the built-in transforms: one tensor in, one tensor out.

    Subclasses implement `_apply(x, batched)`; `batched` says whether `x` carries a leading
    batch dimension in front of the per-sample dims.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the transform to one sample."""
        return self._apply(_as_tensor(x, type(self).__name__), batched=False)

    def apply_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the transform to every sample of a stack (dim 0 indexes the samples) at once."""
        return self._apply(_as_tensor(x, type(self).__name__), batched=True)

    def _apply(self, x: torch.Tensor, batched: bool) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _as_tensor(x: object, who: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{who}: expected a tensor or array, got {type(x).__name__}") from e


_NAMES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a torch dtype or a name such as ``"int32"`` or ``"torch.float32"``.

    Args:
        dtype: ``torch.int32``, ``"int32"``, ``"mindspore.int32"``, ``"float32"``, ...

    Returns:
        The torch dtype.

    Raises:
        TypeError: neither a torch dtype nor a string.
        ValueError: an unknown name; the message lists the known ones.

    Example:
        >>> to_dtype("int32")
        torch.int32
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(
            f"expected a torch dtype such as torch.int32 or a name such as 'int32', "
            f"got {type(dtype).__name__}"
        )
    name = dtype.rsplit(".", 1)[-1].lower()
    if name not in _NAMES:
        raise ValueError(f"unknown dtype name {dtype!r}; known: {', '.join(_NAMES)}")
    return _NAMES[name]


class TypeCast(Transform):
    """Cast a column to `dtype` (MindSpore's ``mindspore.dataset.transforms.TypeCast``).

    Args:
        dtype: a torch dtype (``torch.int32``) or its name (``"int32"``).

    Example:
        >>> TypeCast(torch.int32)(torch.tensor(7, dtype=torch.uint32))
        tensor(7, dtype=torch.int32)

    Note:
        torch's ``CrossEntropyLoss`` wants int64 (or uint8) class indices, so a PyTorch loss
        needs ``TypeCast(torch.int64)`` where a MindSpore script writes ``TypeCast(ms.int32)``.
    """

    def __init__(self, dtype: torch.dtype | str) -> None:
        self.dtype = to_dtype(dtype)

    def _apply(self, x: torch.Tensor, batched: bool) -> torch.Tensor:
        return x.to(self.dtype)
