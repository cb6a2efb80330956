"""`AutoParallel`: a semi_auto operator-parallel wrapper around a network of primitives.

On the first call (`AutoParallel.plan`): step 1 (`_plan.trace_calls`, `_plan.plan_network`),
step 2 (`_runtime.shard_parameters`) and the gradient hooks of step 4
(`_runtime.register_grad_reduction`). Every call (`AutoParallel.forward`) then runs step 3:
hooks on the primitives (`_before` / `_after`) redistribute each input from the layout it has
(`_Tracker`) to the layout its plan wants, run the primitive on the local blocks, apply the
plan's collectives and record the output layouts. Inputs arrive and outputs leave data
parallel: dim 0 split over all ranks, each rank passing / getting its own rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.layout import TensorLayout
from shardwise.ops import Primitive
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._plan import NetworkPlan, Shape, plan_network, trace_calls
from shardwise.parallel._runtime import (
    apply_comms,
    data_parallel_layout,
    register_grad_reduction,
    shard_parameters,
)
from shardwise.redistribution import redistribute


class _Tracker:
    """Layout and global shape of every tensor produced during one forward, keyed by id (the
    tensor is kept so that its id is not reused before `clear`)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[torch.Tensor, TensorLayout, Shape]] = {}

    def put(self, t: torch.Tensor, layout: TensorLayout, shape: Shape) -> None:
        self._seen[id(t)] = (t, layout, shape)

    def get(self, t: torch.Tensor, who: str) -> tuple[TensorLayout, Shape]:
        found = self._seen.get(id(t))
        if found is None or found[0] is not t:
            raise UnsupportedParallelError(
                f"{who}: an input was not produced by a shardwise primitive (or is not the "
                f"network input); unannotated torch ops are not supported by the runtime yet"
            )
        return found[1], found[2]

    def clear(self) -> None:
        self._seen.clear()


def _global_shape(x: torch.Tensor, world: int) -> Shape:
    """The global shape of a data-parallel input of which `x` is this rank's rows."""
    return (int(x.shape[0]) * world, *(int(s) for s in x.shape[1:]))


class AutoParallel(nn.Module):
    """Run `network` operator-parallel as its primitives' strategies say (semi_auto).

    Args:
        network: a module whose compute is shardwise primitives, parameters passed directly as
            primitive inputs.
        parallel_mode: only ``"semi_auto"``.

    Every rank calls it with its rows of the global batch and gets its rows of the output. The
    loss built on them must be the same value on every rank (e.g. ``AllReduce()(loss) / n``):
    the gradient hooks treat the n replicas as one loss (sum over replicas, then / n). After
    ``backward`` each parameter holds this rank's block and that block's gradient, so any
    torch.optim optimizer (built before or after the first call) updates the blocks.

    Limits of this slice: every activation must come from a shardwise primitive (no
    unannotated torch ops between them), non-tensor primitive inputs, Gather's masked lookup and
    Dropout's global mask are refused, and once planned the primitives only run through the
    wrapper (same calls, same order, same shapes every step).
    """

    def __init__(self, network: nn.Module, parallel_mode: str = "semi_auto") -> None:
        super().__init__()
        if parallel_mode != "semi_auto":
            raise ValueError(f"AutoParallel: parallel_mode {parallel_mode!r}; only 'semi_auto'")
        self.network = network
        self.parallel_mode = parallel_mode
        self.network_plan: NetworkPlan | None = None
        self._tracker = _Tracker()
        self._cursor = 0
        self._hooks: list[Any] = []

    def plan(self, *inputs: torch.Tensor) -> NetworkPlan:
        """Plan with the global shapes of these per-rank inputs and shard the parameters (once)."""
        if self.network_plan is not None:
            return self.network_plan
        world = comm.get_group_size()
        shapes = [_global_shape(x, world) for x in inputs]
        plan = plan_network(trace_calls(self.network, shapes), world)
        shard_parameters(self.network, plan.params)
        self._hooks += register_grad_reduction(self.network, plan.params)
        for m in self.network.modules():
            if isinstance(m, Primitive):
                self._hooks.append(m.register_forward_pre_hook(self._before, with_kwargs=True))
                self._hooks.append(m.register_forward_hook(self._after))
        self.network_plan = plan
        return plan

    def forward(self, *inputs: torch.Tensor) -> Any:
        plan = self.plan(*inputs)
        world = comm.get_group_size()
        self._cursor = 0
        self._tracker.clear()
        for x in inputs:
            layout = data_parallel_layout(plan.matrix, x.dim())
            self._tracker.put(x, layout, _global_shape(x, world))
        try:
            out = self.network(*inputs)
            if self._cursor != len(plan.calls):
                raise RuntimeError(
                    f"AutoParallel: the network made {self._cursor} primitive calls, the plan "
                    f"has {len(plan.calls)}; the network must call the same primitives each time"
                )
            return self._to_data_parallel(out)
        finally:
            self._tracker.clear()

    def _to_data_parallel(self, out: Any) -> Any:
        if isinstance(out, tuple | list):
            return type(out)(self._to_data_parallel(o) for o in out)
        if not isinstance(out, torch.Tensor):
            return out
        layout, shape = self._tracker.get(out, "AutoParallel output")
        return redistribute(out, layout, data_parallel_layout(layout.matrix, len(shape)), shape)

    def _current(self, module: nn.Module) -> Any:
        assert self.network_plan is not None
        calls = self.network_plan.calls
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
        tensors, _ = module.split_call(*args)
        local = []
        for i, (t, dst, shape) in enumerate(
            zip(tensors, cp.inputs, cp.call.input_shapes, strict=True)
        ):
            if i in cp.call.params:  # already this rank's block (step 2)
                local.append(t)
                continue
            src, _ = self._tracker.get(t, cp.plan.who)
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
        return outs[0] if single else tuple(outs)
