"""``sw.nn``: helpers for manual parallel training (`DistributedGradReducer`)."""

from shardwise.nn.grad_reducer import DistributedGradReducer

__all__ = ["DistributedGradReducer"]
