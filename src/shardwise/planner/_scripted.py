"""Refusing TorchScript in a captured call: `refuse_scripted`.

A ``torch.jit.script`` or ``torch.jit.trace`` module (``RecursiveScriptModule``,
``TopLevelTracedModule``) and a scripted function run their ops in the TorchScript
interpreter, which calls no Python-level torch function: capture's recorders never see those
ops, so a plan made from the call lacks them (and the run then fails inside the interpreter).
`refuse_scripted` names the first such module or function before anything is captured, with
the fixes: the eager module, or ``parallel_mode="data_parallel"`` (no capture: the network runs
as it is on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from shardwise.planner._recorders import CaptureError


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


def _scripted_modules(
    networks: Sequence[nn.Module], outside: Sequence[nn.Module]
) -> Iterator[tuple[str, nn.Module]]:
    """Each TorchScript module of `networks` (named by its qualified name, the outermost
    first) and of `outside` (the modules a train step uses besides them), with how the
    message names it."""
    for i, net in enumerate(networks):
        prefix = "" if len(networks) == 1 else f"{i}."
        for name, module in net.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                where = f"submodule {prefix + name!r}" if prefix + name else "the network itself"
                yield where, module
    for module in outside:
        for name, sub in module.named_modules():
            if isinstance(sub, torch.jit.ScriptModule):
                inner = f"submodule {name!r} of " if name else ""
                yield f"{inner}a module the train step uses besides the network", sub


def refuse_scripted(
    fn: nn.Module | Callable[..., Any],
    networks: Sequence[nn.Module],
    outside: Sequence[nn.Module],
) -> None:
    """Raise `CaptureError` for the first TorchScript module of `networks` or `outside`, or
    TorchScript function the train step `fn` calls, naming it and the fixes.

    Example:
        >>> refuse_scripted(step, [net], [])  # doctest: +SKIP
        CaptureError: submodule '0' (RecursiveScriptModule of Linear) is a TorchScript module ...
    """
    for where, module in _scripted_modules(networks, outside):
        raise CaptureError(
            f"AutoParallel: {where} ({_kind(module)}) is a TorchScript module "
            f"(torch.jit.script or torch.jit.trace): "
            + _fixes("the eager module (the nn.Module given to torch.jit.script / trace)")
        )
    if isinstance(fn, nn.Module):
        return
    from shardwise.parallel._discover import find_script_functions

    for function in find_script_functions(fn):
        raise CaptureError(
            f"AutoParallel: the train step calls {function.name!r}, a TorchScript "
            f"function (torch.jit.script): "
            + _fixes("the Python function given to torch.jit.script")
        )
