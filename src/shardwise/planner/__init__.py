"""Planning: capture a network's op graph, give every op a strategy, keep the result as a
`ParallelPlan`. Nothing here touches a process group.

- `_capture`: `capture` (every op of a forward or train step, on fake tensors) -> `Graph`.
- `_recorders`: capture's torch-function and dispatch modes (one `Node` per torch-level call,
  with its aten ops); `_module_hooks`: its module hooks (module paths, primitives as one
  node); `_op_form_calls`: the call an op-form ``sw.shard`` annotation applies to (the
  module's forward's, not its hooks'); `_call_kinds`: `record_kind` (how capture and the
  executor treat a call) and what a differentiation call asks for; `_mid_step`: the
  differentiation inside a step the capture refuses (torch.func transforms,
  ``torch.autograd.functional``, ops on mid-step gradients it cannot plan); `_out_calls`: a
  call with ``out=`` tensors as the node of its result, which the out tensors hold.
- `_graph`: `Graph` and its parts (global shapes and dtypes only, no tensor data).
- `_semi_auto`: `plan_semi_auto` (annotated ops keep their strategies, every other op data
  parallel, through the sharding rules of `shardwise.ops`) -> `ParallelPlan`.
- `_propagate`: `plan_sharding_propagation` (annotated ops keep their strategies, every other
  op the one that makes the whole graph's redistributions cheapest): `_choices` (every node's
  candidate strategies; one node's in `_one_node`), `_tie` (repeated layers decide alike),
  `_gc` (the collector paused while planning), `_cost` (the alpha-beta `CostModel`,
  `load_cost_model`), `_solve` (exact: tree DP or an ILP through HiGHS; MindSpore's greedy
  order for comparison).
- `_search`: `plan_recursive_programming` (no annotation needed: every op's strategy and the
  device matrix chosen by the total cost: communication including the ops' own collectives,
  compute (`_flops`), memory under the ``set_memory`` cap); `_plan_cost`: `plan_cost` prices
  any plan by the same model, `step_cost` estimates its training step; `_explain`: why each op
  has its strategy.
- `_follow`: an op's aten program followed on placements (the strategy of an unannotated or
  op-form annotated op, the cheaper of following and data parallel); `_even`: a rule's
  decision checked against shardwise's equal blocks (a partial sum all-reduced where a
  ReduceScatter would cut a dim unevenly).
- `_placement`: the global device matrix and where inputs and parameters start.
- `_backward`: `plan_backward`, the last planning step: where a replicated value's gradient is
  averaged over an axis (Megatron's ``f``) so that forward AllReduces' adjoints and replicated
  parameters' gradient reductions over that axis become local.
- `_seeded`: `plan_seeded`, after it: the AllReduces whose adjoint is local when
  ``loss.backward()`` starts with no gradient (only ops alike on every rank read the value);
  `plan_deferred`: the weighted mean loss whose seeded backward does not wait for the count;
  `root_collectives`: the ops' own AllReduces that make the loss, whose adjoint is local too.
- `_annotated`: ``sw.shard``'s op form and ``sw.reshard`` read from the graph.
- `_plan`: `ParallelPlan` and its parts (frozen, printable, diffable); `_regions`: the
  activation-checkpointed regions capture notes (`Region`: which ops backward runs again);
  `_regathered`: the parameters optimizer parallel level 3 gathers again in backward.
- `_plan_json`: a `ParallelPlan` as JSON and back (`ParallelPlan.to_dict` / `from_dict`).
- `_files`: operator and parameter strategy files, checked against the network on load.
"""

from shardwise.planner._capture import CaptureError, FakeKernelError, capture
from shardwise.planner._cost import CostModel, load_cost_model
from shardwise.planner._files import (
    StrategyFileError,
    check_decisions,
    check_device_count,
    check_matches,
    check_params,
    dtype_mismatch,
    load_operator_strategy_file,
    load_param_strategy_file,
    save_operator_strategy_file,
    save_param_strategy_file,
)
from shardwise.planner._graph import AtenArg, AtenCall, Graph, Node, Ref, TensorInfo
from shardwise.planner._plan import (
    BucketPlan,
    Collective,
    EdgePlan,
    NodePlan,
    ParallelPlan,
    ParamPlan,
    Placed,
    Root,
)
from shardwise.planner._plan_cost import PlanCost, StepCost, plan_cost, replayed_moves, step_cost
from shardwise.planner._propagate import plan_sharding_propagation
from shardwise.planner._regathered import regathered_params
from shardwise.planner._regions import Region
from shardwise.planner._search import plan_recursive_programming
from shardwise.planner._seeded import root_collectives
from shardwise.planner._semi_auto import PlanError, plan_semi_auto

__all__ = [
    "AtenArg",
    "AtenCall",
    "BucketPlan",
    "CaptureError",
    "Collective",
    "CostModel",
    "EdgePlan",
    "FakeKernelError",
    "Graph",
    "Node",
    "NodePlan",
    "ParallelPlan",
    "ParamPlan",
    "Placed",
    "PlanCost",
    "PlanError",
    "Ref",
    "Region",
    "Root",
    "StepCost",
    "StrategyFileError",
    "TensorInfo",
    "capture",
    "check_decisions",
    "check_device_count",
    "check_matches",
    "check_params",
    "dtype_mismatch",
    "load_cost_model",
    "load_operator_strategy_file",
    "load_param_strategy_file",
    "plan_cost",
    "plan_recursive_programming",
    "plan_semi_auto",
    "plan_sharding_propagation",
    "regathered_params",
    "replayed_moves",
    "root_collectives",
    "save_operator_strategy_file",
    "save_param_strategy_file",
    "step_cost",
]
