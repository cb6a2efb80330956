"""Primitives: ``sw.ops.*``.

For now the seven collective primitives of manual parallel (defined in
`shardwise.communication`); the shardable compute primitives (MatMul, ReLU, ...) and their
sharding rules join them with operator-level parallel.
"""

from shardwise.communication import (
    AllGather,
    AllReduce,
    AlltoAll,
    Broadcast,
    NeighborExchange,
    NeighborExchangeV2,
    ReduceOp,
    ReduceScatter,
)

__all__ = [
    "AllGather",
    "AllReduce",
    "AlltoAll",
    "Broadcast",
    "NeighborExchange",
    "NeighborExchangeV2",
    "ReduceOp",
    "ReduceScatter",
]
