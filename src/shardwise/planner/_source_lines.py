"""Where a captured call comes from, for capture's error messages.

- `source_line`: the user's ``file:line`` of the running call (the innermost frame outside torch
  and shardwise, `user_frame`).
- `library_read`: where inside torch a value read happens, with what to pass instead
  (`LIBRARY_READS`: torch's ``_detect_is_causal_mask`` reads an attention mask), or "".
- `read_name`: the name of a value read as the user called it (``tolist``, not its ``item``s).
- `data_dependent`: the message for a call that fake tensors cannot run: an output whose
  shape depends on values (``x[mask]``), or a value read inside torch itself
  (``F.gaussian_nll_loss``'s check of its variances, ``torch.cov``).
- `fake_kernel` / `fake_kernel_refused`: a call whose Python meta kernel raised, and the message
  naming the kernel, the user's line and what to use instead; `captured_note`: the note added
  to any other torch error a call raises during the capture (the call and the user's line).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import traceback
from pathlib import Path
from types import FrameType

import torch

_SKIP_FILES = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
_TORCH_DIR = str(Path(torch.__file__).parent)
_STDLIB_SKIP = frozenset({contextlib.__file__, copy.__file__})  # (``with``, ``copy.deepcopy``)
LIBRARY_READS = {
    "_detect_is_causal_mask": (
        "torch checks whether the attention mask is causal by reading it; pass is_causal=True "
        "(src_is_causal= / tgt_is_causal= for nn.Transformer) when the mask is causal, False "
        "when it is not"
    ),
}
"""torch functions that read a tensor's value, with what the user passes instead."""


def user_frame() -> FrameType | None:
    """The innermost frame outside torch and shardwise (the user's code running), or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIP_FILES) and name not in _STDLIB_SKIP:
            return frame
        frame = frame.f_back
    return None


def source_line() -> str:
    """``file:line`` of the innermost caller outside torch and shardwise (called from a
    recorder's hook)."""
    frame = user_frame()
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


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


def read_name(name: str) -> str:
    """The name of a value read as the user called it: fake tensors' ``tolist`` reads each
    element with ``item``, named ``torch.Tensor.tolist`` (called from a recorder's hook)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FILES):
        if frame.f_code.co_name == "tolist":
            return "torch.Tensor.tolist"
        frame = frame.f_back  # type: ignore[assignment]
    return name


SHAPE_HINTS = {
    "pack_padded_sequence": (
        "run the recurrent layer on the padded batch without packing, and mask the padded "
        "steps' outputs, or take each sequence's last step with torch.gather"
    ),
    "bincount": (
        "counts of a known number of bins E: F.one_hot(ids, E).sum(0), or torch.zeros(E)"
        ".index_add_(0, ids, torch.ones(len(ids)))"
    ),
    "unique": (
        "a fixed number of candidates: a one-hot or comparison mask over all E values "
        "(F.one_hot(ids, E)) instead of the distinct values found"
    ),
    "repeat_interleave": "repeats given as a Python int, or a fixed-capacity layout with a mask",
    "": "a mask and torch.where instead of indexing by a boolean tensor",
}
"""What to write instead of an op whose output is shaped by values, by a part of its name."""

VALUE_READ_HINTS = {
    "one_hot": "pass the number of classes: F.one_hot(ids, num_classes=E)",
    "cov": "torch.cov / torch.corrcoef from means, products and sums",
    "corrcoef": "torch.cov / torch.corrcoef from means, products and sums",
    "gaussian_nll_loss": (
        "F.gaussian_nll_loss: 0.5 * (torch.log(var) + (input - target) ** 2 / var), its mean"
    ),
    "": (
        "torch.cov / torch.corrcoef: from means, products and sums; F.gaussian_nll_loss: "
        "0.5 * (torch.log(var) + (input - target) ** 2 / var), its mean"
    ),
}
"""What to write instead of a call that reads a value inside torch, by a part of its name."""

NO_CAPTURE = (
    "; or run the step with parallel_mode='data_parallel', which captures nothing and runs it "
    "as written"
)
"""The way to run a refused call as written (said after each capture refusal's own fix)."""

NOT_CAPTURABLE = {
    "ctc_loss": (
        "the shape of its output (the alignment table) depends on the values of the target "
        "lengths, which fake tensors do not have, and torch has no form of it with fixed "
        "shapes; compute the loss outside "
        "the wrapped step: wrap the network (parallel = sw.AutoParallel(net): each rank gets "
        "its rows of the outputs) and call the loss on them, made the same on every rank by "
        "hand (reduction='mean': sw.ops.AllReduce()(F.ctc_loss(log_probs, targets, "
        "input_lengths, target_lengths)) / n, each rank passing its rows of the targets and "
        "lengths; 'sum': without / n), or run the step with parallel_mode='data_parallel'"
    ),
}
"""Ops whose output is shaped by values that have no replacement of a fixed shape: how to run
them outside the capture, by a part of the op's name."""

_VALUE_READS = ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero", "aten.item")
_TORCH_PUBLIC = tuple(
    os.path.join(_TORCH_DIR, part)
    for part in ("nn", "functional.py", "distributions", "_refs", "_decomp", "linalg", "fft")
)


def data_dependent(op: str, e: BaseException) -> str:
    """The capture's message for call `op`, which fake tensors could not run (`e`: torch's
    ``DataDependentOutputException``), at the user's line: a value read inside torch (with
    torch's function and line where Python reads it) or an output shaped by values."""
    func = str(getattr(e, "func", ""))
    if not func.startswith(_VALUE_READS):
        outside = next((h for name, h in NOT_CAPTURABLE.items() if name in op), None)
        if outside is not None:
            return f"{op} at {source_line()} cannot be captured ({type(e).__name__}): {outside}"
        instead = next((h for name, h in SHAPE_HINTS.items() if name in op), SHAPE_HINTS[""])
        return (
            f"{op} at {source_line()} has an output whose shape depends on tensor values "
            f"({type(e).__name__}), which capture cannot follow; use an op with a fixed output "
            f"shape ({instead}){NO_CAPTURE}"
        )
    where = ""
    for frame, line in traceback.walk_tb(e.__traceback__):
        name = frame.f_code.co_filename
        if name.startswith(_TORCH_PUBLIC):
            where = f" ({os.path.basename(name)}:{line}, {frame.f_code.co_name})"
    instead = next(
        (h for name, h in VALUE_READ_HINTS.items() if name and name in op), VALUE_READ_HINTS[""]
    )
    return (
        f"{op} at {source_line()} reads a tensor's value inside torch{where} ({func}: a check "
        f"or a Python number of a tensor) while the network is captured (fake tensors have no "
        f"values); write it with ops that do not read values ({instead}){NO_CAPTURE}"
    )


_META_KERNELS = os.path.join(_TORCH_DIR, "_meta_registrations.py")
FAKE_KERNEL_HINTS = {
    "grouped_mm": (
        "Hugging Face mixture-of-experts layers: experts_implementation='batched_mm' in the "
        "model's config"
    ),
}
"""What to use instead of an op torch's fake kernel refuses, by a part of the kernel's name."""


def fake_kernel(e: BaseException) -> str | None:
    """The function of torch's Python meta kernels (``torch/_meta_registrations.py``) that
    raised `e` (the innermost one), or None when `e` did not come from one."""
    found = None
    for frame, _ in traceback.walk_tb(e.__traceback__):
        if frame.f_code.co_filename == _META_KERNELS:
            found = frame.f_code.co_name
    return found


def fake_kernel_refused(op: str, kernel: str, e: BaseException) -> str:
    """The capture's message for call `op` whose meta kernel (`kernel`) raised `e`: a shape
    error the real op raises as well, or a check the meta kernel makes and the real one does
    not (``F.grouped_mm``'s takes bfloat16 only; its CPU kernel float32 too)."""
    instead = next((h for name, h in FAKE_KERNEL_HINTS.items() if name in kernel), None)
    why = str(e).rstrip(".")
    fix = (
        f"; if it runs there, the fake kernel checks more than the real one and capture cannot "
        f"run it: use {instead or 'an op (or a dtype) the fake kernel takes'}"
    )
    return (
        f"{op} at {source_line()} failed while the step was captured on fake tensors (shapes "
        f"and dtypes only): torch's fake kernel {kernel} refused it: {why}. If it fails on one "
        f"device too, fix what torch names{fix}"
    )


def captured_note(op: str) -> str:
    """The note added to torch's own error raised by call `op` during the capture."""
    return f"(raised by {op} at {source_line()} while shardwise captured the step on fake tensors)"
