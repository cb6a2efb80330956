"""Telling TorchScript among the aten ops no torch-level call runs: `scripted_refusal`.

A ``torch.jit.script`` or ``torch.jit.trace`` module (``RecursiveScriptModule``,
``TopLevelTracedModule``) and a scripted function run their ops in the TorchScript
interpreter, which calls aten ops directly, with no torch-level call around them: the
capture's torch-function recorder does not see them, so a plan made from the call would lack
them. When the dispatch recorder meets an aten op with no torch-level call around it
(`_aten_recorder.AtenRecorder`), `scripted_refusal` looks at what runs it:

- the innermost module being run is a TorchScript module: it is named, by its qualified name in
  the network, or as a module the train step uses besides it;
- the Python code that called into C++ (the innermost frame outside shardwise and torch's
  dispatch and compile wrappers) can call TorchScript functions (the globals it loads, its
  locals and closure, and those attributes of its local modules: ``self.activation``): they
  are named, with the user's ``file:line``;
- that code is the user's own (C++ it called directly): the op and the ``file:line`` are named;
- that code is torch's (a custom ``autograd.Function``'s ``apply`` detaching its outputs):
  nothing is refused (None).

The message gives the fixes: the eager module or Python function, or
``parallel_mode="data_parallel"`` (no capture: the network runs as it is on every rank).
TorchScript the capture does not run (a module the network only holds, code after the step's
``backward()`` or in a branch not taken) is never refused.
"""

from __future__ import annotations

import builtins
import os
import sys
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

import torch
from torch import nn

from shardwise.planner._source_lines import source_line

_TORCH_DIR = os.path.dirname(torch.__file__)
_PASSING = (
    os.path.dirname(os.path.dirname(__file__)),  # (shardwise)
    *(os.path.join(_TORCH_DIR, p) for p in ("_dynamo", "_compile.py", "_ops.py")),
    os.path.join(_TORCH_DIR, "utils", "_python_dispatch.py"),
)
"""Where the frames between an op's dispatch and the code that called into C++ are."""


def _fixes(eager: str) -> str:
    """Why TorchScript is refused and the fixes (`eager`: what to use instead)."""
    return (
        "its ops run in the TorchScript interpreter, which the capture that plans the call "
        "(every parallel_mode but 'data_parallel') does not see, so the plan would lack them. "
        f"Use {eager}, or parallel_mode='data_parallel', which runs the network as it is on "
        "every rank (docs/parallel.md, 'Not yet')"
    )


def _kind(module: nn.Module) -> str:
    """``RecursiveScriptModule of Linear``: the TorchScript class and the module scripted."""
    original = getattr(module, "original_name", None)
    name = type(module).__name__
    return name if not original or original == name else f"{name} of {original}"


def _module_name(module: nn.Module, paths: Mapping[int, str]) -> str:
    """How the message names a module being run (`paths`: module id -> qualified name)."""
    path = paths.get(id(module))
    if path is None:
        return "a module the train step uses besides the network"
    return f"submodule {path!r}" if path else "the network itself"


def _script_functions(frame: FrameType) -> list[Any]:
    """The TorchScript functions `frame`'s code can call, each once: the globals (or
    builtins) it loads, its locals and closure, and its local modules' attributes of the
    names it loads (``self.act`` holding one)."""
    names = frame.f_code.co_names
    local = list(frame.f_locals.values())
    values = [frame.f_globals.get(n, getattr(builtins, n, None)) for n in names] + local
    values += [v.__dict__.get(n) for v in local if isinstance(v, nn.Module) for n in names]
    found = [v for v in values if isinstance(v, torch.jit.ScriptFunction)]
    return list({id(v): v for v in found}.values())


def _calling_frame() -> FrameType | None:
    """The innermost frame outside shardwise and torch's dispatch and compile wrappers: the
    Python code whose call into C++ dispatched the running op (called from `scripted_refusal`)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PASSING):
        frame = frame.f_back
    return frame


def scripted_refusal(running: Sequence[nn.Module], paths: Mapping[int, str], op: str) -> str | None:
    """The `CaptureError` message for aten op `op` run with no torch-level call around it
    (called from the dispatch recorder): the TorchScript module or function running it and
    the fixes, or None for torch's own C++ (see the module docstring).

    Args:
        running: the modules whose forward runs, the innermost last.
        paths: module id -> its qualified name in the networks.
        op: the aten op (``aten.tanh.default``).

    Example:
        >>> scripted_refusal([net, net.act], {id(net): "", id(net.act): "act"}, "aten.tanh")
        ... # doctest: +SKIP
        "AutoParallel: submodule 'act' (RecursiveScriptModule of Act) is a TorchScript ..."
    """
    line = source_line()
    if running and isinstance(running[-1], torch.jit.ScriptModule):
        module = running[-1]
        return (
            f"AutoParallel: {_module_name(module, paths)} ({_kind(module)}) is a TorchScript "
            f"module (torch.jit.script or torch.jit.trace), run at {line}: "
            + _fixes("the eager module (the nn.Module given to torch.jit.script / trace)")
        )
    caller = _calling_frame()
    functions = [] if caller is None else _script_functions(caller)
    if functions:
        names = " or ".join(repr(f.name) for f in functions)
        return (
            f"AutoParallel: {names}, a TorchScript function (torch.jit.script), runs at "
            f"{line}: " + _fixes("the Python function given to torch.jit.script")
        )
    if caller is None or caller.f_code.co_filename.startswith(_TORCH_DIR):
        return None  # (torch's own C++: an autograd.Function's apply detaching its outputs)
    return (
        f"AutoParallel: {op} runs at {line} with no torch-level call around it, as in "
        f"TorchScript code (a torch.jit.script / torch.jit.trace function or module) called "
        f"there: " + _fixes("the eager Python code")
    )
