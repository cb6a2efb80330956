"""Where a captured call comes from, for capture's error messages.

- `source_line`: the user's ``file:line`` of the running call (the innermost frame outside torch
  and shardwise).
- `library_read`: where inside torch a value read happens, with what to pass instead
  (`LIBRARY_READS`: torch's ``_detect_is_causal_mask`` reads an attention mask), or "".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

_SKIP_FILES = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
_TORCH_DIR = str(Path(torch.__file__).parent)
LIBRARY_READS = {
    "_detect_is_causal_mask": (
        "torch checks whether the attention mask is causal by reading it; pass is_causal=True "
        "(src_is_causal= / tgt_is_causal= for nn.Transformer) when the mask is causal, False "
        "when it is not"
    ),
}
"""torch functions that read a tensor's value, with what the user passes instead."""


def source_line() -> str:
    """``file:line`` of the innermost caller outside torch and shardwise (called from a
    recorder's hook: its caller's callers are searched)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIP_FILES) and "contextlib" not in name:
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def library_read() -> str:
    """Where inside torch a value read happens (``; it is torch's transformer.py:1245
    (_detect_is_causal_mask) that reads it: ...``), or "" when the user's own code reads it
    (called from a recorder's hook)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FILES):
        name = frame.f_code.co_filename
        if name.startswith(_TORCH_DIR) and "overrides" not in name and "_tensor.py" not in name:
            function = frame.f_code.co_name
            hint = LIBRARY_READS.get(function, "see whether an argument of it spares the read")
            where = f"{os.path.basename(name)}:{frame.f_lineno} ({function})"
            return f"; it is torch's {where} that reads it: {hint}"
        frame = frame.f_back  # type: ignore[assignment]
    return ""
