"""`AutoParallel`: the semi_auto operator-parallel wrapper (a network or a train-step function).

On the network's first call (`AutoParallel.plan`): step 1 (`_plan.trace_calls`,
`_plan.plan_network`), step 2 (`_runtime.shard_parameters`) and the gradient hooks of step 4
(`_runtime.register_grad_reduction`; parameters no primitive consumes are replicated and
all-reduced over every rank). Every call then runs step 3 in a session (`_session`): hooks on
the primitives (`_before` / `_after`) redistribute each input from the state it has
(`_tracker.Tracker`) to the layout its plan wants, run the primitive on the local blocks, apply
the plan's collectives and record the output layouts; unannotated torch ops run data parallel
(`_torchops.DataParallelOps`, a TorchFunctionMode active during the session).

Wrapping a network: inputs arrive and outputs leave data parallel (each rank passes / gets its
own rows). Wrapping a train step: every rank passes the global batch; each input is cut by the
dataset strategy (`_step.dataset_input`) and the user's function runs unchanged on the local
blocks, returning its (replicated) loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise import report, runtime
from shardwise.ops import Primitive
from shardwise.parallel._context import (
    check_device_num,
    get_auto_parallel_context,
    resolve_parallel_mode,
)
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._plan import NetworkPlan, Shape, plan_network, trace_calls
from shardwise.parallel._runtime import (
    apply_comms,
    data_parallel_layout,
    register_grad_reduction,
    replicated_layout,
    shard_parameters,
)
from shardwise.parallel._step import (
    DATASET_STRATEGIES,
    dataset_input,
    find_referenced,
    pick_network,
)
from shardwise.parallel._torchops import DataParallelOps
from shardwise.parallel._tracker import State, Tracker, layout_of
from shardwise.redistribution import redistribute


def _global_shape(x: torch.Tensor, world: int) -> Shape:
    """The global shape of a data-parallel input of which `x` is this rank's rows."""
    return (int(x.shape[0]) * world, *(int(s) for s in x.shape[1:]))


def _param_blocks(network: nn.Module, plan: NetworkPlan) -> list[runtime.TensorEstimate]:
    """This rank's parameter tensors: planned ones' local blocks, the others whole."""
    out = []
    for name, p in network.named_parameters():
        shape = tuple(int(s) for s in p.shape)
        if name in plan.params:
            layout, shape = plan.params[name]
            shape = layout.local_shape(shape)
        out.append(runtime.TensorEstimate(name, shape, p.dtype))
    return out


class AutoParallel(nn.Module):
    """Run a network operator-parallel as its primitives' strategies say (semi_auto).

    Args:
        network_or_step: a module (its compute: shardwise primitives, parameters passed directly
            as primitive inputs, and supported unannotated torch ops), or a train-step function
            ``step(*inputs)`` calling such a network, ``loss.backward()`` and
            ``optimizer.step()`` and returning the loss.
        parallel_mode: only ``"semi_auto"``; default (None): from `set_auto_parallel_context`
            (``SEMI_AUTO_PARALLEL`` or the default ``STAND_ALONE`` give semi_auto; other modes
            raise `UnsupportedParallelError`). The context's ``dataset_strategy`` is read here
            too (``dataset_strategy()`` overrides it) and its ``device_num`` checked at plan time.
        network: the network of a train step (default: the referenced module with parameters).
        optimizer: the optimizer(s) of a train step (default: those it references).

    A wrapped module is called on each rank with its rows of the global batch and returns its
    rows of the output; the loss built on them must be the same value on every rank (e.g.
    ``AllReduce()(loss) / n``). A wrapped train step is called with the global batch on every
    rank (`dataset_strategy`) and returns the loss, the same on every rank. The gradient hooks
    treat the n replicas as one loss (sum over replicas, then / n). After ``backward`` each
    parameter holds this rank's block and that block's gradient, so any torch.optim optimizer
    (built before or after the first call) updates the blocks.

    Limits: unannotated torch ops outside `_torchops.OP_KINDS`, non-tensor primitive inputs,
    Gather's masked lookup and Dropout's global mask are refused; once planned the network only
    runs through the wrapper (same primitive calls, same order, same shapes every step).
    """

    def __init__(
        self,
        network_or_step: nn.Module | Callable[..., Any],
        parallel_mode: str | None = None,
        network: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> None:
        super().__init__()
        parallel_mode = resolve_parallel_mode(parallel_mode)
        self.train_step: Callable[..., Any] | None = None
        if isinstance(network_or_step, nn.Module):
            network = network_or_step
            self.optimizers: list[torch.optim.Optimizer] = []
        else:
            self.train_step = network_or_step
            modules, found = find_referenced(network_or_step)
            network = network if network is not None else pick_network(modules)
            given = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
            self.optimizers = list(given) if given is not None else found
        self.network = network
        self.parallel_mode = parallel_mode
        self.network_plan: NetworkPlan | None = None
        self._dataset: str = get_auto_parallel_context("dataset_strategy")
        self._tracker = Tracker()
        self._ops: DataParallelOps | None = None
        self._cursor = 0
        self._planning = False
        self._hooks: list[Any] = [
            network.register_forward_pre_hook(self._enter_network),
            network.register_forward_hook(self._leave_network),
        ]

    def dataset_strategy(self, strategy: str) -> AutoParallel:
        """How each input of the wrapped call is split: ``"data_parallel"`` (the default: a
        train step gets the global batch and keeps this rank's rows; a module gets this rank's
        rows) or ``"full_batch"`` (every rank keeps the whole batch). Returns self."""
        if strategy not in DATASET_STRATEGIES:
            raise ValueError(
                f"AutoParallel.dataset_strategy: {strategy!r}; supported: {DATASET_STRATEGIES} "
                f"(per-input tuples / Layouts are not supported yet)"
            )
        self._dataset = strategy
        return self

    def plan(self, *inputs: torch.Tensor, shapes: Sequence[Shape] | None = None) -> NetworkPlan:
        """Plan with the global shapes of the network's inputs and shard the parameters (once).

        `shapes` default: these inputs as this rank's rows of data-parallel inputs."""
        if self.network_plan is not None:
            return self.network_plan
        world = comm.get_group_size()
        check_device_num(world)
        if shapes is None:
            shapes = [_global_shape(x, world) for x in inputs]
        self._planning = True
        try:
            plan = plan_network(trace_calls(self.network, shapes), world)
            report.dump_plan(plan, self.network, shapes, self._dataset)  # save_graphs >= 1
        finally:
            self._planning = False
        runtime.check_memory(_param_blocks(self.network, plan), "AutoParallel.plan")
        shard_parameters(self.network, plan.params)
        self._hooks += register_grad_reduction(self.network, plan.params)
        self._hooks += register_grad_reduction(self.network, self._replicated_params(plan))
        for m in self.network.modules():
            if isinstance(m, Primitive):
                self._hooks.append(m.register_forward_pre_hook(self._before, with_kwargs=True))
                self._hooks.append(m.register_forward_hook(self._after))
        self.network_plan = plan
        return plan

    def _replicated_params(self, plan: NetworkPlan) -> dict[str, tuple[Any, Shape]]:
        """The parameters no primitive consumes (unannotated modules): whole on every rank."""
        return {
            name: (replicated_layout(plan.matrix, p.dim()), tuple(int(s) for s in p.shape))
            for name, p in self.network.named_parameters()
            if name not in plan.params
        }

    def forward(self, *inputs: Any) -> Any:
        if self.train_step is not None:
            with self._session():
                local = [dataset_input(x, self._dataset, self._tracker) for x in inputs]
                return self.train_step(*local)
        world = comm.get_group_size()
        with self._session():
            for x in inputs:
                if self._dataset == "full_batch":
                    self._tracker.put(x, "rep", tuple(int(s) for s in x.shape))
                else:
                    self._tracker.put(x, "dp", _global_shape(x, world))
            out = self.network(*inputs)
            self._pause(1)
            return self._to_data_parallel(out)

    @contextmanager
    def _session(self) -> Iterator[None]:
        """Track activations and run unannotated torch ops data parallel during one call."""
        plan = self.network_plan
        sharded = [] if plan is None else [id(self.network.get_parameter(n)) for n in plan.params]
        self._tracker.clear()
        self._cursor = 0
        self._ops = DataParallelOps(self._tracker, sharded)
        try:
            with self._ops:
                yield
        finally:
            self._ops = None
            self._tracker.clear()

    def _pause(self, delta: int) -> None:
        if self._ops is not None:
            self._ops.paused += delta

    def _enter_network(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._planning:
            return
        if self._ops is None:
            raise RuntimeError(
                "AutoParallel: the wrapped network was called outside the wrapper; call the "
                "AutoParallel object (or the train step it wraps) instead"
            )
        if self.network_plan is None:
            shapes = [self._state(t)[1] for t in args if isinstance(t, torch.Tensor)]
            self._pause(1)
            try:
                self.plan(shapes=shapes)
            finally:
                self._pause(-1)
            self._ops.sharded = {id(self.network.get_parameter(n)) for n in self._plan().params}
        self._cursor = 0

    def _leave_network(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._planning:
            return
        calls = self._plan().calls
        if self._cursor != len(calls):
            raise RuntimeError(
                f"AutoParallel: the network made {self._cursor} primitive calls, the plan "
                f"has {len(calls)}; the network must call the same primitives each time"
            )

    def _plan(self) -> NetworkPlan:
        assert self.network_plan is not None
        return self.network_plan

    def _state(self, t: torch.Tensor) -> tuple[State, Shape]:
        found = self._tracker.find(t)
        return found if found is not None else ("rep", tuple(int(s) for s in t.shape))

    def _to_data_parallel(self, out: Any) -> Any:
        if isinstance(out, tuple | list):
            return type(out)(self._to_data_parallel(o) for o in out)
        if not isinstance(out, torch.Tensor):
            return out
        state, shape = self._tracker.get(out, "AutoParallel output")
        if isinstance(state, str):  # "dp" rows or a whole ("rep") value: as they are
            return out
        return redistribute(out, state, data_parallel_layout(state.matrix, len(shape)), shape)

    def _current(self, module: nn.Module) -> Any:
        calls = self._plan().calls
        if self._cursor >= len(calls) or calls[self._cursor].call.module is not module:
            raise RuntimeError(
                f"AutoParallel: primitive call {self._cursor} differs from the planned one; the "
                f"network must call the same primitives in the same order each time"
            )
        return calls[self._cursor]

    def _before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        cp = self._current(module)
        assert isinstance(module, Primitive)
        if cp.plan.local:
            raise UnsupportedParallelError(
                f"{cp.plan.who}: local mode {cp.plan.local!r} not supported"
            )
        self._pause(1)  # until `_after`: the primitive and its redistributions run as written
        tensors, _ = module.split_call(*args)
        local = []
        for i, (t, dst, shape) in enumerate(
            zip(tensors, cp.inputs, cp.call.input_shapes, strict=True)
        ):
            if i in cp.call.params:  # already this rank's block (step 2)
                local.append(t)
                continue
            state, _ = self._tracker.get(t, cp.plan.who)
            src = layout_of(state, self._plan().matrix, len(shape))
            local.append(redistribute(t, src, dst, shape))
        rest = args[len(tensors) :]
        if "shape" in cp.call.call_args:  # Reshape: the local target shape
            shape_arg = cp.plan.local_output_shapes()[0]
            names = [k for k, _ in module.call_args]
            if "shape" in kwargs:
                kwargs = {**kwargs, "shape": shape_arg}
            else:
                rest = tuple(
                    shape_arg if n == "shape" else a for n, a in zip(names, rest, strict=False)
                )
        return (*local, *rest), kwargs

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        cp = self._current(module)
        single = isinstance(output, torch.Tensor)
        outs = apply_comms([output] if single else list(output), cp.plan)
        for t, layout, shape in zip(outs, cp.outputs, cp.plan.output_shapes, strict=True):
            self._tracker.put(t, layout, shape)
        self._cursor += 1
        self._pause(-1)
        return outs[0] if single else tuple(outs)
