"""shardwise: MindSpore's distributed parallel training for PyTorch users.

``import shardwise as sw``; see README.md for the architecture and API.md for the contract.
"""

from shardwise import communication, ops
from shardwise.communication import CommRecorder

__version__ = "0.1.0"

__all__ = ["CommRecorder", "__version__", "communication", "ops"]
