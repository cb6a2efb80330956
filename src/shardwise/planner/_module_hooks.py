"""Capture's module hooks (`_module_hooks`): each node's module path (and the modules being
run, `_State.running`, which name a TorchScript module that runs), a shardwise primitive
recorded as one node (its inner calls unrecorded, `_recorders._State.add_node` at its end),
and the op-form ``sw.shard`` strategies of the modules being run (`_op_form_calls`: the one
call of such a module's forward takes it; its hooks' calls are unannotated).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardwise.ops import Primitive
from shardwise.planner._graph import op_strategy
from shardwise.planner._op_form_calls import Annotated
from shardwise.planner._recorders import _State, tensors_in

T = torch.Tensor


@contextmanager
def module_hooks(s: _State) -> Iterator[None]:
    """Module paths for the nodes, and shardwise primitives recorded as single nodes."""
    pending: dict[int, tuple[list[T], int | None]] = {}  # (its inputs, `saved_before`)

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        path = s.modules.get(id(module))
        if isinstance(module, Primitive) and not s.inside_primitive and not s.done:
            ins = tensors_in(module.split_call(*args)[0])
            pending[id(module)] = ins, s.regions.saved_before()
            s.inside_primitive += 1
        s.stack.append(path if path is not None else type(module).__name__)
        s.running.append(module)
        strategy = op_strategy(module)
        if strategy is not None and not s.inside_primitive and not s.done:
            s.annotated.append(Annotated(s.stack[-1], strategy, module))

    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if s.annotated and s.stack and s.annotated[-1].path == s.stack[-1]:
            s.annotated.pop()
        if s.stack:
            s.stack.pop()
        if s.running:
            s.running.pop()
        found = pending.pop(id(module), None)
        if found is None:
            return
        ins, saved = found
        s.inside_primitive -= 1
        assert isinstance(module, Primitive)
        outs = tensors_in(output)
        _, call_args = module.split_call(*args)
        s.stack.append(s.modules.get(id(module), module.name))
        try:
            op = f"shardwise.ops.{module.name}"
            s.add_node(op, module, ins, outs, ((), dict(call_args)), saved_before=saved)
        finally:
            s.stack.pop()

    handles = [
        nn.modules.module.register_module_forward_pre_hook(pre),
        nn.modules.module.register_module_forward_hook(post),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
