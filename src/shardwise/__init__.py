"""shardwise: MindSpore's distributed parallel training for PyTorch users.

``import shardwise as sw``; README.md describes the architecture, API.md the contract.
"""

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
from shardwise.parameter import Parameter, initializer, no_init_parameters, set_comm_fusion
from shardwise.train import Model

__version__ = "0.1.0"

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
