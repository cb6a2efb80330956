"""Step 3, run: the hooks that execute one wrapped call on this rank (`CallRuntime`).

`AutoParallel` (`_auto.py`) derives from `CallRuntime`, which holds the per-call machinery:

- `_session`: one wrapped call: the activation `Tracker`, the `DataParallelOps` mode for
  unannotated torch ops, `_shard.activate` for `sw.reshard` / `sw.shard`.
- `_enter_network` / `_leave_network`: the network's forward hooks (plan on the first call,
  level-3 saved-tensor hooks of optimizer parallel, the primitive-call count check).
- `_before` / `_after`: each primitive's hooks: redistribute every input to the plan's layout
  (parameters from the layout they are stored in, through optimizer parallel's compute leaves),
  the special local compute of `_local.prepare`, the plan's collectives, the output layouts.
- `_whole_param`: a parameter whole for an unannotated torch op inside the network.
- `global_shape` / `reshard` / `declare_parameters`: the `_shard.Session` protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from shardwise.communication import recorder
from shardwise.layout import TensorLayout
from shardwise.ops import Primitive
from shardwise.optim import OptimizerParallel
from shardwise.parallel._local import Masked, prepare
from shardwise.parallel._plan import NetworkPlan, Shape
from shardwise.parallel._runtime import (
    GradBuckets,
    apply_comms,
    data_parallel_layout,
    replicated_layout,
)
from shardwise.parallel._shard import Declared, Entry, activate, to_layout
from shardwise.parallel._torchops import DataParallelOps
from shardwise.parallel._tracker import State, Tracker, layout_of
from shardwise.redistribution import redistribute


class CallRuntime(nn.Module):
    """The per-call hooks of `AutoParallel` (see the module docstring); state set by
    `AutoParallel.__init__` and `AutoParallel.plan`."""

    network: nn.Module
    network_plan: NetworkPlan | None
    _tracker: Tracker
    _ops: DataParallelOps | None
    _cursor: int
    _planning: bool
    _fixup: Masked | None
    _declared: Declared
    _engine: OptimizerParallel | None
    _grads: GradBuckets | None
    _layouts: dict[int, tuple[TensorLayout, Shape]]
    _saved: ExitStack
    _graph: Any  # `_graph_run.GraphRun` once a network of plain torch ops is planned
    _graph_planning: bool

    plan: Callable[..., NetworkPlan]  # AutoParallel.plan

    # -- `sw.reshard` / `sw.shard` (the `_shard.Session` protocol) -------------------------
    def global_shape(self, t: torch.Tensor) -> Shape:
        """The tracked global shape of `t` (its own shape when untracked)."""
        return self._state(t)[1]

    def reshard(self, t: torch.Tensor, entry: Entry) -> torch.Tensor:
        """Move `t` to the layout `entry` names (declared only, while planning)."""
        layout = to_layout(entry, self.global_shape(t), "sw.reshard")
        if self._planning:
            self._declared.matrices.append(layout.matrix.shape)
            return t
        plan = self._plan()
        state, shape = self._state(t)
        self._pause(1)
        try:
            dst = layout_of(layout, plan.matrix, len(shape))
            out = redistribute(t, layout_of(state, plan.matrix, len(shape)), dst, shape)
        finally:
            self._pause(-1)
        self._tracker.put(out, dst, shape)
        return out

    def declare_parameters(self, owner: nn.Module | None, plan: Mapping[str, Entry]) -> None:
        """Record a `parameter_plan` while planning (names relative to `owner`)."""
        if self._planning:
            self._declared.add(self.network, owner, plan)

    @contextmanager
    def _session(self) -> Iterator[None]:
        """Track activations and run unannotated torch ops data parallel during one call."""
        self._tracker.clear()
        self._cursor = 0
        self._ops = DataParallelOps(self._tracker, self._sharded(), self._whole_param)
        try:
            with self._ops, activate(self):
                yield
        finally:
            self._saved.close()
            self._ops = None
            self._tracker.clear()

    def _sharded(self) -> dict[int, bool]:
        """Parameter id -> whether it is stored as a block (not whole), for every parameter a
        torch op inside the network must get through `_whole_param`."""
        engine = self._engine
        out = {}
        for key, (layout, _) in self._layouts.items():
            cut = bool(layout.used_axes())
            if engine is not None:
                name = engine.by_id.get(key)
                cut = cut or (name is not None and engine.shards[name].sharded)
                out[key] = cut
            elif cut:
                out[key] = True
        return out

    def _whole_param(self, p: torch.Tensor) -> torch.Tensor:
        """Parameter `p` whole, for an unannotated torch op inside the network: its compute
        leaf (optimizer parallel) or its block, gathered when its op-level layout splits it."""
        layout, shape = self._layouts[id(p)]
        value = p if self._engine is None else self._engine.compute(p)
        if not layout.used_axes():
            return value
        self._pause(1)
        try:
            return redistribute(value, layout, replicated_layout(layout.matrix, len(shape)), shape)
        finally:
            self._pause(-1)

    def _pause(self, delta: int) -> None:
        if self._ops is not None:
            self._ops.paused += delta

    def _enter_network(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._planning or self._graph_planning or self._graph is not None:
            return
        if self._ops is None:
            raise RuntimeError(
                "AutoParallel: the wrapped network was called outside the wrapper; call the "
                "AutoParallel object (or the train step it wraps) instead"
            )
        if self.network_plan is None:
            tensors = [t for t in args if isinstance(t, torch.Tensor)]
            found = [self._state(t) for t in tensors]
            self._pause(1)
            try:
                self.plan(
                    shapes=[f[1] for f in found],
                    states=[f[0] for f in found],
                    dtypes=[t.dtype for t in tensors],
                )
            finally:
                self._pause(-1)
            self._ops.sharded = self._sharded()
        self._cursor = 0
        self._ops.in_network += 1
        recorder.mark("forward")
        if self._grads is not None:
            self._grads.drop_unfinished()  # (a backward that raised)
        if self._engine is not None:
            self._saved.enter_context(self._engine.saved_tensors())

    def _leave_network(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._planning or self._graph_planning or self._graph is not None:
            return
        if self._ops is not None:
            self._ops.in_network -= 1
        self._saved.close()
        if self._engine is not None:
            self._engine.end_forward()
        recorder.mark("forward done")
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

    def _to_output(self, out: Any, whole: bool) -> Any:
        """A wrapped network's output as it leaves: this rank's rows (data parallel), or the
        whole value on every rank when `whole` (``"full_batch"`` inputs)."""
        if isinstance(out, tuple | list):
            return type(out)(self._to_output(o, whole) for o in out)
        if not isinstance(out, torch.Tensor):
            return out
        state, shape = self._tracker.get(out, "AutoParallel output")
        if state == "rep" or not shape:  # a whole value or a scalar: as is
            return out
        if not whole and state == "dp":
            return out
        matrix, ndim = self._plan().matrix, len(shape)
        to = replicated_layout if whole else data_parallel_layout
        return redistribute(out, layout_of(state, matrix, ndim), to(matrix, ndim), shape)

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
        self._pause(1)  # until `_after`: the primitive and its redistributions run as written
        tensors, _ = module.split_call(*args)
        local = []
        for i, (t, dst, shape) in enumerate(
            zip(tensors, cp.inputs, cp.call.input_shapes, strict=True)
        ):
            if i in cp.call.params:  # this rank's block (step 2) in the layout it is stored in
                src = self._plan().params[cp.call.params[i]][0]
                t = t if self._engine is None else self._engine.compute(t)
                local.append(t if src == dst else redistribute(t, src, dst, shape))
                continue
            state, _ = self._state(t)  # untracked: a constant, the same on every rank
            src = layout_of(state, self._plan().matrix, len(shape))
            local.append(redistribute(t, src, dst, shape))
        local, self._fixup = prepare(
            module, cp.plan.local, local, cp.inputs, cp.call.input_shapes, dict(cp.call.call_args)
        )
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
        outs = [output] if single else list(output)
        if self._fixup is not None:
            outs, self._fixup = self._fixup.apply(outs), None
        outs = apply_comms(outs, cp.plan)
        for t, layout, shape in zip(outs, cp.outputs, cp.plan.output_shapes, strict=True):
            self._tracker.put(t, layout, shape)
        self._cursor += 1
        self._pause(-1)
        return outs[0] if single else tuple(outs)
