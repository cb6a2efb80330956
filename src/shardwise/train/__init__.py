"""``sw.train``: `Model` and its callbacks (LossMonitor, TimeMonitor, ModelCheckpoint)."""

from shardwise.train.callbacks import Callback, LossMonitor, RunContext, TimeMonitor
from shardwise.train.model import Accuracy, Model

__all__ = ["Accuracy", "Callback", "LossMonitor", "Model", "RunContext", "TimeMonitor"]
