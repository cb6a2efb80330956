"""The hooks of data-parallel mode's runner (`DataParallelRunner`) and its registry.

- `step_hook`: an optimizer's step pre-hook (post-hook) calling the runner's `_before_step`
  (`_after_step`) with that optimizer while the runner lives, a step's closure handed on
  averaging its gradients.
- `adopt_hook`: a global step pre-hook: an optimizer over the network's parameters that the
  runner was not given (the module form's; a train step's it did not find) is taken at its
  first step; one holding all the parameters of known optimizers (a swap, or one built anew in
  each call) replaces them (`replaced`).
- `RUNNERS` / `state_on_owners`: each network's current runner, and whether it keeps optimizer
  state on owner ranks (its checkpoint files then record the job's size).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.communication import recorder
from shardwise.optim._data_parallel_plan import WHO, param_ids
from shardwise.optim._global_hooks import replace_closure

if TYPE_CHECKING:
    from shardwise.optim._data_parallel import DataParallelRunner

StepHook = Callable[[torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]], Any]

RUNNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[DataParallelRunner]] = (
    weakref.WeakKeyDictionary()
)  # each network's current runner


def state_on_owners(network: nn.Module) -> bool:
    """Whether `network` is run by a `DataParallelRunner` that updates some parameters on their
    owner rank only (``parallel_optimizer=True``), so that each rank's optimizer holds the state
    of the parameters it updates and the ranks' checkpoint files are one checkpoint together.

    Args:
        network: a network (the runner's, or any other).

    Returns:
        True when its runner (not removed) has owners.

    Example:
        >>> state_on_owners(net)   # after DataParallelRunner(net, [opt], parallel_optimizer=True)
        True
    """
    ref = RUNNERS.get(network)
    runner = None if ref is None else ref()
    return runner is not None and runner._finalizer.alive and bool(runner.owners)


def step_hook(ref: weakref.ReferenceType[DataParallelRunner], after: bool) -> StepHook:
    """A known optimizer's step pre-hook (`after`: post-hook) calling the runner while it
    lives: `_before_step` (`_after_step`) with the stepping optimizer (the runner finds its
    index, which changes when an earlier optimizer is replaced). A step's closure, whose
    backward runs inside the step, is handed on wrapped: the gradients it made are averaged
    when it returns, before the update (`_average`)."""

    def hook(opt: torch.optim.Optimizer, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        runner = ref()
        if runner is None:
            return None
        with recorder.phase("step"):  # (the optimizer step's collectives)
            if after:
                runner._after_step(opt)
                return None
            wrapped = replace_closure(args, kw, lambda closure: _averaging(ref, opt, closure))
            runner._before_step(opt, closure=wrapped is not None)
        return wrapped

    return hook


def _averaging(
    ref: weakref.ReferenceType[DataParallelRunner],
    opt: torch.optim.Optimizer,
    closure: Callable[..., Any],
) -> Callable[..., Any]:
    """`closure`, then the runner's average of optimizer `opt`'s gradients."""

    def averaged(*args: Any, **kwargs: Any) -> Any:
        loss = closure(*args, **kwargs)
        runner = ref()
        if runner is not None:
            with recorder.phase("step"):
                runner._average(opt)
        return loss

    return averaged


def replaced(runner: DataParallelRunner, opt: torch.optim.Optimizer) -> list[int]:
    """The indices of the known optimizers that `opt` (not known, stepping over the network's
    parameters) replaces: those whose trainable parameters it all holds (a swap mid-training,
    one built anew in each call, an optimizer stepped again after another replaced it, one over
    the parameters left trainable after freezing a layer).

    Raises:
        ValueError: `opt` holds some parameters of a known optimizer but not all (which one
            trains them is ambiguous; a layer replaced after the first call), or, with
            ``parallel_optimizer=True`` (owners planned once), any known one's or none.
    """
    new = param_ids(opt)
    held = [param_ids(o) for o in runner.optimizers]
    shared = [i for i, ps in enumerate(held) if ps & new]
    # (a frozen parameter the new one leaves out trains under neither)
    trained = [param_ids(o, trainable=True) for o in runner.optimizers]
    name = type(opt).__name__
    if runner.parallel_optimizer and shared:
        raise ValueError(
            f"{WHO}: a {name} the wrapper was not given steps parameters that an optimizer "
            "it knows holds (an optimizer swapped mid-training, or built anew in each call); "
            "with parallel_optimizer=True (hsdp()) each parameter's owner rank and its "
            "optimizer state are planned once, for the optimizers of the first call, so a new "
            "optimizer cannot take over: change the known optimizer's settings in place (for "
            "g in opt.param_groups: g['lr'] = ...), or use parallel_mode='semi_auto' with "
            "hsdp(), which plans again for a new optimizer"
        )
    if runner.parallel_optimizer:
        raise ValueError(
            f"{WHO}: a {name} the wrapper was not given steps the network's parameters; with "
            "parallel_optimizer=True each parameter's owner is planned once: pass every "
            "optimizer with optimizers= (or keep it where the train step's code names it, not "
            "in a container)"
        )
    partial = [i for i in shared if not trained[i] <= new]
    if partial:
        i = partial[0]
        raise ValueError(
            f"{WHO}: a {name} the wrapper was not given steps {len(held[i] & new)} of the "
            f"{len(held[i])} parameters of a known optimizer (optimizers[{i}], a "
            f"{type(runner.optimizers[i]).__name__}), not all of them, so which optimizer "
            "trains the others is ambiguous (one built after a layer of the network "
            "was replaced? one over part of the network replacing an optimizer over all of "
            "it?); build a new optimizer over all the parameters of the one it replaces (or "
            "over parameters no known optimizer holds). data_parallel mode trains the network "
            "as it was at its first call: replace layers before wrapping it, or use semi_auto, "
            "which plans again for replaced parameters"
        )
    return shared


def adopt_hook(ref: Any) -> StepHook:
    """A global optimizer step pre-hook: an optimizer the runner does not know (the module
    form's, built after the wrapper as documented; a train step's kept in a container or
    stepped first in a later call; one swapped in mid-training, or built anew in each call)
    that holds one of the network's parameters is adopted (`DataParallelRunner.adopt`) before
    its update, so its gradients are averaged from its first step (they were never averaged:
    each rank drifted on its rows); the known optimizers whose parameters it all holds leave
    the runner (`replaced`). One stepped inside a known optimizer's step (a wrapper's inner
    optimizer: Lookahead, Accelerate's) is left alone: the outer step averaged. With
    ``parallel_optimizer=True``, whose owners are planned once, or one holding only some of a
    known optimizer's parameters, it is a ValueError (`replaced`)."""

    def hook(opt: torch.optim.Optimizer, _args: tuple[Any, ...], _kw: dict[str, Any]) -> None:
        runner = ref()
        if runner is None or any(opt is known for known in runner.optimizers):
            return  # (every later step of an adopted one: nothing to look at)
        if not runner.is_current():
            return  # (the network was wrapped again: the newer runner adopts it)
        if runner.stepping:  # (inside a known one's step, which averaged: a Lookahead's inner)
            return
        mine = {id(p) for p in runner.network.parameters()}
        if not any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            return
        runner.adopt(opt, replacing=replaced(runner, opt))

    return hook
