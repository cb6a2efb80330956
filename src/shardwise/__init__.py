"""shardwise: MindSpore's distributed parallel training for PyTorch users.

``import shardwise as sw``; README.md describes the architecture, API.md the contract.
"""

from shardwise import communication, dataset, nn, ops, train
from shardwise.communication import CommRecorder
from shardwise.context import get_seed, set_seed
from shardwise.train import Model

__version__ = "0.1.0"

__all__ = [
    "CommRecorder",
    "Model",
    "__version__",
    "communication",
    "dataset",
    "get_seed",
    "nn",
    "ops",
    "set_seed",
    "train",
]
