"""shardwise: MindSpore's distributed parallel training for PyTorch users.

``import shardwise as sw``; README.md describes the architecture, API.md the contract.

The package imports its parts on first use (``sw.AutoParallel`` imports the planner,
``sw.save_checkpoint`` the checkpoint code): ``shardwise run`` and a worker that only
communicates start without loading DTensor or ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardwise import (
        checkpoint,
        communication,
        dataset,
        layout,
        nn,
        ops,
        parallel,
        parameter,
        redistribution,
        report,
        runtime,
        train,
    )
    from shardwise.checkpoint import (
        load_checkpoint,
        load_param_into_net,
        save_checkpoint,
        transform_checkpoints,
    )
    from shardwise.communication import CommRecorder
    from shardwise.context import get_context, get_seed, set_context, set_seed
    from shardwise.layout import Layout, strided
    from shardwise.parallel import (
        AutoParallel,
        ParallelMode,
        get_auto_parallel_context,
        reset_auto_parallel_context,
        reshard,
        set_auto_parallel_context,
        shard,
    )
    from shardwise.parameter import (
        Parameter,
        initializer,
        no_init_parameters,
        set_comm_fusion,
    )
    from shardwise.train import Model

__version__ = "0.1.0"

_SUBPACKAGES = frozenset(
    {
        "checkpoint", "communication", "dataset", "layout", "nn", "ops", "parallel",
        "parameter", "redistribution", "report", "runtime", "train",
    }
)  # fmt: skip

# Each public name and the module it lives in.
_HOMES = {
    "load_checkpoint": "checkpoint",
    "load_param_into_net": "checkpoint",
    "save_checkpoint": "checkpoint",
    "transform_checkpoints": "checkpoint",
    "CommRecorder": "communication",
    "get_context": "context",
    "get_seed": "context",
    "set_context": "context",
    "set_seed": "context",
    "Layout": "layout",
    "strided": "layout",
    "AutoParallel": "parallel",
    "ParallelMode": "parallel",
    "get_auto_parallel_context": "parallel",
    "reset_auto_parallel_context": "parallel",
    "reshard": "parallel",
    "set_auto_parallel_context": "parallel",
    "shard": "parallel",
    "Parameter": "parameter",
    "initializer": "parameter",
    "no_init_parameters": "parameter",
    "set_comm_fusion": "parameter",
    "Model": "train",
}

__all__ = [
    "AutoParallel",
    "CommRecorder",
    "Layout",
    "Model",
    "ParallelMode",
    "Parameter",
    "__version__",
    "checkpoint",
    "communication",
    "dataset",
    "get_auto_parallel_context",
    "get_context",
    "get_seed",
    "initializer",
    "layout",
    "load_checkpoint",
    "load_param_into_net",
    "nn",
    "no_init_parameters",
    "ops",
    "parallel",
    "parameter",
    "redistribution",
    "report",
    "reset_auto_parallel_context",
    "reshard",
    "runtime",
    "save_checkpoint",
    "set_auto_parallel_context",
    "set_comm_fusion",
    "set_context",
    "set_seed",
    "shard",
    "strided",
    "train",
    "transform_checkpoints",
]


if not TYPE_CHECKING:  # type checkers see the imports above; a typo stays an error there

    def __getattr__(name: str) -> Any:
        """Import a part of shardwise the first time it is used (PEP 562)."""
        if name in _SUBPACKAGES:
            value: Any = importlib.import_module(f"shardwise.{name}")
        elif name in _HOMES:
            value = getattr(importlib.import_module(f"shardwise.{_HOMES[name]}"), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"shardwise.{name}"):
            value = importlib.import_module(f"shardwise.{name}")  # (sw.planner, sw.optim, ...)
        else:
            raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
