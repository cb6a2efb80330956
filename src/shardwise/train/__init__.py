"""``sw.train``: `Model`, its callbacks and checkpoint resume.

- `model`: `Model` (train / eval loop), `Accuracy`.
- `callbacks`: `Callback`, `RunContext`, `LossMonitor`, `TimeMonitor`.
- `checkpoint_callback`: `ModelCheckpoint`, `CheckpointConfig`, `resume`.
"""

from shardwise.train.callbacks import Callback, LossMonitor, RunContext, TimeMonitor
from shardwise.train.checkpoint_callback import CheckpointConfig, ModelCheckpoint, resume
from shardwise.train.model import Accuracy, Model

__all__ = [
    "Accuracy",
    "Callback",
    "CheckpointConfig",
    "LossMonitor",
    "Model",
    "ModelCheckpoint",
    "RunContext",
    "TimeMonitor",
    "resume",
]
