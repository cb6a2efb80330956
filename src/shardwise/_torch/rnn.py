"""``nn.RNNBase.check_hidden_size``: torch's recurrent modules check their initial state's
sizes in this undocumented method, which `parallel/_rnn_checks` replaces on an instance while a
plan runs.

- `HIDDEN_CHECK`: the method's name; `hidden_check(module)`: the class's own check bound to
  `module` (None where torch no longer has it: the instance is then left as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

HIDDEN_CHECK = "check_hidden_size"


def hidden_check(module: nn.Module) -> Callable[..., Any] | None:
    """The check ``type(module)`` defines, bound to `module` (a subclass's override too)."""
    own = getattr(type(module), HIDDEN_CHECK, None)
    return None if own is None else own.__get__(module)
