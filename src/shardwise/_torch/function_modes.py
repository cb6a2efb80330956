"""The torch-function mode stack, entry by entry.

The plan executor (`parallel/_stepping.py`) takes itself off the stack while an optimizer steps,
so that the step's hundreds of update ops never reach Python, and puts itself back at the same
depth afterwards, under modes entered meanwhile. The public API only enters and leaves modes in
order (``with mode:``); these read, pop and push the stack directly.

Bound once here, not wrapped: they run at every optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

len_torch_function_stack: Callable[[], int] = torch._C._len_torch_function_stack
"""How many torch-function modes are on this thread's stack."""

get_function_stack_at: Callable[[int], Any] = torch._C._get_function_stack_at
"""The mode at depth `i` (0: the bottom)."""

pop_torch_function_stack: Callable[[], Any] = torch._C._pop_torch_function_stack
"""Take the top mode off the stack and return it."""

push_on_torch_function_stack: Callable[[Any], None] = torch._C._push_on_torch_function_stack
"""Put a mode on top of the stack (without calling its ``__enter__``)."""
