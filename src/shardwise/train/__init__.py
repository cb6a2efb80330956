"""``sw.train``: `Model`, its callbacks and checkpoint resume.

- `model`: `Model` (train / eval loop); `_metrics`: its metrics `Accuracy` and `Loss`.
- `callbacks`: `Callback`, `RunContext`, `LossMonitor`, `TimeMonitor`.
- `checkpoint_callback`: `ModelCheckpoint`, `CheckpointConfig`, `resume`.
"""

from shardwise.train._metrics import Accuracy, Loss
from shardwise.train.callbacks import Callback, LossMonitor, RunContext, TimeMonitor
from shardwise.train.checkpoint_callback import CheckpointConfig, ModelCheckpoint, resume
from shardwise.train.model import Model

__all__ = [
    "Accuracy",
    "Callback",
    "CheckpointConfig",
    "Loss",
    "LossMonitor",
    "Model",
    "ModelCheckpoint",
    "RunContext",
    "TimeMonitor",
    "resume",
]
