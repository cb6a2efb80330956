"""Primitives: ``sw.ops.*``.

- The seven collective primitives of manual parallel (defined in `shardwise.communication`).
- The shardable compute primitives (`primitives`: ``MatMul``, ``ReLU``, ... each a
  `torch.nn.Module` with ``.shard(in_strategy, out_strategy)``), `name_primitives`.
- Their sharding rules (`rules`: ``RULES``, `plan_primitive`) and what a rule returns
  (`OpPlan`, `Comm`). docs/ops.md lists the primitives, the rules and the errors.
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
from shardwise.ops._base import Primitive, name_primitives, normalize_strategy
from shardwise.ops._plan import Comm, OpPlan, Rule, Strategy
from shardwise.ops.primitives import (
    Add,
    BatchMatMul,
    BiasAdd,
    Div,
    Dropout,
    Flatten,
    Gather,
    GeLU,
    LayerNorm,
    LogSoftmax,
    MatMul,
    Mul,
    ReduceMean,
    ReduceSum,
    ReLU,
    Reshape,
    Sigmoid,
    Softmax,
    SoftmaxCrossEntropyWithLogits,
    Sub,
    Tanh,
    Transpose,
)
from shardwise.ops.rules import FAMILIES, RULES, plan_primitive

__all__ = [
    "FAMILIES",
    "RULES",
    "Add",
    "AllGather",
    "AllReduce",
    "AlltoAll",
    "BatchMatMul",
    "BiasAdd",
    "Broadcast",
    "Comm",
    "Div",
    "Dropout",
    "Flatten",
    "Gather",
    "GeLU",
    "LayerNorm",
    "LogSoftmax",
    "MatMul",
    "Mul",
    "NeighborExchange",
    "NeighborExchangeV2",
    "OpPlan",
    "Primitive",
    "ReLU",
    "ReduceMean",
    "ReduceOp",
    "ReduceScatter",
    "ReduceSum",
    "Reshape",
    "Rule",
    "Sigmoid",
    "Softmax",
    "SoftmaxCrossEntropyWithLogits",
    "Strategy",
    "Sub",
    "Tanh",
    "Transpose",
    "name_primitives",
    "normalize_strategy",
    "plan_primitive",
]
