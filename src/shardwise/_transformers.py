"""Hugging Face transformers' attention masks, built alike by the capture and the run.

transformers builds attention masks in ``transformers.masking_utils``. Several of its steps read
a tensor's values to take a shortcut, except while tracing, which it asks of
``is_tracing(tensor)``, true for a ``FakeTensor``: skipping the mask when a padding mask has
nothing padded (``_ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa``: SDPA
attention with ``attention_mask=``, a decoder that makes a mask of ones), and dropping the
packed-sequence mask when ``position_ids`` hold one sequence per row
(``find_packed_sequence_indices``: training without a cache, e.g. with gradient checkpointing
or ``use_cache=False``). The capture runs on fake tensors and takes the traced path; a real call
read the values instead, so its ops differed from the plan's, which could not run.
`same_masks` makes ``masking_utils.is_tracing`` answer true for a tensor inside the block, in
the capture and in the run alike: the masks are always built as the traced path builds them
(the results equal the shortcuts', which exist only to pick faster kernels), and no value is
read. ``is_tracing()`` without a tensor (compiling, scripting) answers as transformers does.
Nothing happens when transformers is not imported. The name is checked by
``tests/parallel/test_hf_masks.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_NAME = "is_tracing"


def _traced_for_tensors(original: Callable[..., bool]) -> Callable[..., bool]:
    def is_tracing(tensor: Any = None) -> bool:
        return True if tensor is not None else original()

    is_tracing.shardwise_original = original  # type: ignore[attr-defined]
    return is_tracing


@contextmanager
def same_masks() -> Iterator[None]:
    """While the block runs, transformers' mask utilities take their traced path for every
    tensor (see the module docstring).

    Example:
        >>> with same_masks():  # doctest: +SKIP
        ...     loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    """
    module = sys.modules.get("transformers.masking_utils")
    own = getattr(module, _NAME, None) if module is not None else None
    if own is None or hasattr(own, "shardwise_original"):  # (none, or inside such a block)
        yield
        return
    setattr(module, _NAME, _traced_for_tensors(own))
    try:
        yield
    finally:
        setattr(module, _NAME, own)


__all__ = ["same_masks"]
