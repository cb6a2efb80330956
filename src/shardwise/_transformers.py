"""Hugging Face transformers' attention-mask shortcuts, taken alike by the capture and the run.

transformers builds attention masks in ``transformers.masking_utils``. With SDPA attention and a
padding mask given (``model(input_ids=ids, attention_mask=mask, ...)``, or a decoder that makes
one of ones), its private ``_ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa``
read the mask's values (``padding_mask.all()``) to skip building the mask when nothing is
padded, except while tracing, which transformers recognizes by a ``FakeTensor``. So the
capture (fake tensors) always builds the mask while a real call reads the values and skips it:
the ops differ, and the plan cannot run. `same_masks` makes those two functions answer
"do not skip" whenever a padding mask is given, in the capture and in the run alike: the mask
is always built, the results are those of the skipped path (SDPA with the full causal or
bidirectional mask equals ``is_causal``), and no value is read. Without a padding mask (a value
the functions do not read) they answer as transformers does. Nothing happens when transformers
is not imported. The two names are checked by ``tests/parallel/test_hf_masks.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_NAMES = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


def _built_when_padded(original: Callable[..., bool]) -> Callable[..., bool]:
    def never_with_a_mask(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        return False if padding_mask is not None else original(padding_mask, *args, **kwargs)

    never_with_a_mask.shardwise_original = original  # type: ignore[attr-defined]
    return never_with_a_mask


@contextmanager
def same_masks() -> Iterator[None]:
    """While the block runs, transformers' SDPA mask shortcuts do not read a padding mask's
    values (see the module docstring).

    Example:
        >>> with same_masks():  # doctest: +SKIP
        ...     loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    """
    module = sys.modules.get("transformers.masking_utils")
    saved = {n: getattr(module, n) for n in _NAMES if hasattr(module, n)} if module else {}
    for name, fn in saved.items():
        if not hasattr(fn, "shardwise_original"):  # (not already inside such a block)
            setattr(module, name, _built_when_padded(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


__all__ = ["same_masks"]
