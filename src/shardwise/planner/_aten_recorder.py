"""Capture's dispatch recorder: `AtenRecorder`, the aten program of each torch-level call.

`AtenRecorder` is the ``TorchDispatchMode`` under the torch-function recorder
(`_recorders._Recorder`): while a recorded call runs, it lists the aten ops that call runs
(`AtenCall`s on `AtenArg`s: the call's inputs and the program's own temporaries) in
`_State.aten`. Under inference mode, a composite aten op arrives whole and is decomposed into
the parts the planner knows.

Every aten op that Python code runs comes inside a torch-level call (`_State.calls`); one
dispatched with none around it comes from C++ code: torch's own (a custom
``autograd.Function``'s ``apply`` detaching its outputs: recorded as before, each a node of
the aten op), or the TorchScript interpreter (a ``torch.jit.script`` / ``torch.jit.trace``
module or a scripted function), whose ops the plan would lack. `_scripted.scripted_refusal`
tells them apart; TorchScript is refused there with a `CaptureError` naming what ran, kept in
`_State.refused` for `capture` to raise (the interpreter turns any error raised inside it into
its own RuntimeError).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise._torch import pytree
from shardwise._torch.dispatch import TorchDispatchMode
from shardwise.ops import _flat as flat
from shardwise.planner._graph import AtenArg, AtenCall
from shardwise.planner._recorders import CaptureError, _State, info_of
from shardwise.planner._scripted import scripted_refusal

T = torch.Tensor


class AtenRecorder(TorchDispatchMode):
    """Lists the aten ops of the running node (`_State.aten`); refuses one that no torch-level
    call runs (see the module docstring)."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.s = state

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "prim":  # (a fake tensor's device, asked for by C++: ~3 an op)
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        s = self.s
        if not s.calls and not s.done and not s.inside_primitive and func.namespace == "aten":
            refused = scripted_refusal(s.running, s.modules, str(func))
            if refused is not None:  # (TorchScript: no torch-level call runs it)
                s.refused = CaptureError(refused)
                raise s.refused
        if torch.is_inference_mode_enabled() and func.namespace == "aten":
            # (autograd's key is off: composite ops such as aten.linear arrive whole; their
            # parts, as the planner knows them elsewhere, come back through this mode)
            with self:
                parts = func.decompose(*args, **kwargs)
            if parts is not NotImplemented:
                return parts
        out = func(*args, **kwargs)
        if s.aten is None or func.namespace != "aten":
            return out

        def arg(x: Any) -> Any:
            if not isinstance(x, T):
                return x
            found = s.aten_ids.get(id(x))
            if found is None:  # a tensor the program made without an op (a lifted constant)
                found = AtenArg(
                    "tmp", s.tmp, info_of(x), tuple(x.stride()), int(x.storage_offset())
                )
                s.tmp += 1
                s.aten_ids[id(x)] = found
                s.keep.append(x)
            return found

        if flat.plain((args, kwargs, out)):  # (as torch gives aten calls their arguments)
            a, k = flat.map_only(T, arg, (args, kwargs))
            results = flat.leaves(out)
        else:
            a, k = pytree.tree_map(arg, (args, kwargs))
            results = pytree.tree_leaves(out)
        made = []
        for t in results:
            if isinstance(t, T) and id(t) not in s.aten_ids:
                s.aten_ids[id(t)] = AtenArg(
                    "tmp", s.tmp, info_of(t), tuple(t.stride()), int(t.storage_offset())
                )
                s.tmp += 1
                s.keep.append(t)
            elif isinstance(t, T):  # (an in-place op's own output: its metadata as it is now)
                s.aten_ids[id(t)] = _now(s.aten_ids[id(t)], t)
            if isinstance(t, T):
                made.append(s.aten_ids[id(t)])
        s.aten.append(AtenCall(func, tuple(a), dict(k), tuple(made)))
        return out


def _now(known: AtenArg, t: T) -> AtenArg:
    """`known` with `t`'s shape, stride and offset: an op that changes its input's metadata in
    place (``squeeze_``, ``transpose_``) returns it as a tensor of another shape."""
    info, stride, offset = info_of(t), tuple(t.stride()), int(t.storage_offset())
    if (info, stride, offset) == (known.info, known.stride, known.offset):
        return known
    return AtenArg(known.kind, known.index, info, stride, offset)
