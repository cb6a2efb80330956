"""The module hooks of a planned network (`NetworkHooks`, a base of `_graph_run.GraphRun`).

- `NetworkHooks._network_called` (the network's forward pre-hook): tells the running executor
  that the network's forward begins (`_spans`); refuses a call of the network outside its
  wrapper once its parameters hold this rank's blocks or shards (and names ``copy.deepcopy``
  when the network is a copy made after the first call).
- `NetworkHooks._enter` / `_leave` (each shardwise primitive's forward pre- and post-hook):
  hand the primitive's call to the running executor (`PlanExecutor.enter_primitive` /
  ``leave_primitive``); nothing during the capture; a primitive called outside the wrapper is
  refused.
- `noted_annotations` / `check_annotations`: the strategies the modules a plan ran carried when
  it was made (a primitive's ``shard()``, ``sw.shard``'s op form); a call after one changed, or
  after such a module was replaced in the network, is refused (the plan, and the parameters'
  storage, keep the old ones).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.ops import Primitive
from shardwise.ops._spec_checks import fmt_strategy
from shardwise.parallel._ownership import CopiedHooks, copied
from shardwise.planner._graph import Graph, op_strategy

if TYPE_CHECKING:
    from shardwise.parallel._executor import PlanExecutor


class NetworkHooks:
    """The network's and its primitives' hooks (the attributes below are `GraphRun`'s)."""

    copied = False  # (`_ownership.CopiedHooks`: this run's hooks bound to a copy's)
    executor: PlanExecutor | None
    capturing: bool
    blocks: bool
    network: nn.Module

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A deep copy of the network copies its hooks, methods of this object: they are bound
        to a `CopiedHooks` instead (the copy is not planned, nor is this run copied), and the
        copy's blocks are recorded as stored by this plan (its checkpoint describes them)."""
        copy = memo.get(id(self.network))
        if isinstance(copy, nn.Module) and self.blocks:
            copied(copy, self.network)
        return CopiedHooks(self.blocks)

    def _network_called(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Tell the running executor that the network's forward begins (`_spans`); refuse a
        call of the network outside the wrapper once its parameters hold blocks or shards (it
        would compute on them as if they were whole)."""
        if self.executor is not None:
            self.executor.network_entered()
        elif not self.capturing and self.blocks:
            if self.copied:
                raise RuntimeError(
                    f"AutoParallel: {type(module).__name__} is a copy of a planned network "
                    "(copy.deepcopy after its first call); its parameters hold this rank's "
                    "blocks or shards, so it cannot run as a whole network: copy it before the "
                    "first call, or load its state into the planned network and call its wrapper"
                )
            raise RuntimeError(
                f"AutoParallel: {type(module).__name__} was called outside its wrapper; its "
                "parameters hold this rank's blocks, so call the AutoParallel object (or the "
                "train step it wraps) instead"
            )

    def _enter(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self.capturing:
            return None
        if self.executor is None:
            raise RuntimeError(
                "AutoParallel: the wrapped network was called outside the wrapper; call the "
                "AutoParallel object (or the train step it wraps) instead"
            )
        assert isinstance(module, Primitive)
        return self.executor.enter_primitive(module, args, kwargs)

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.executor is None or self.capturing:
            return None
        assert isinstance(module, Primitive)
        return self.executor.leave_primitive(module, args, output)


Annotation = tuple[nn.Module, str, object, object]
"""A module the plan ran, its path in the network ("": none), and the two strategies it carried
(a primitive's in / out strategy, or ``sw.shard``'s op-form strategy and None)."""


def _strategies(module: nn.Module) -> tuple[object, object]:
    if isinstance(module, Primitive):
        return module.in_strategy, module.out_strategy
    return op_strategy(module), None


def noted_annotations(network: nn.Module, graph: Graph) -> list[Annotation]:
    """The modules of `network` that `graph`'s ops ran in (its primitives included), with their
    paths and the strategies they carry now (when planning)."""
    paths = {id(m): path for path, m in network.named_modules()}
    by_path = {path: m for path, m in network.named_modules()}
    noted: dict[int, Annotation] = {}
    for node in graph.nodes:
        module = node.target if node.is_primitive else by_path.get(node.module)
        if isinstance(module, nn.Module) and id(module) not in noted:
            noted[id(module)] = (module, paths.get(id(module), ""), *_strategies(module))
    return list(noted.values())


def _held(network: nn.Module, path: str) -> nn.Module | None:
    """The module at `path` of `network` now, seen through the wrappers that run the module
    they wrap (activation checkpointing's, ``torch.compile``'s); None when it is gone."""
    try:
        module = network.get_submodule(path)
    except AttributeError:  # (deleted)
        return None
    for inner in ("_checkpoint_wrapped_module", "_orig_mod"):
        module = getattr(module, inner, module)
    return module


def _who(module: nn.Module, path: str) -> str:
    return module.who if isinstance(module, Primitive) else path or "the network"


def check_annotations(network: nn.Module, noted: list[Annotation]) -> None:
    """Refuse a call after a module the plan ran changed its strategies, or one that carried a
    strategy (or is a primitive) was replaced in the network, since `noted_annotations` noted
    it.

    Raises:
        ValueError: naming the module, the planned strategy and the fix.
    """
    for module, path, *was in noted:
        now = _strategies(module)
        held = path and (was != [None, None] or isinstance(module, Primitive))
        if held and _held(network, path) is not module:
            raise ValueError(
                f"AutoParallel: {path} was replaced in the network after the first call (the "
                f"plan ran the module it held then, {_who(module, path)}); build the network as "
                f"it trains before the first call, or wrap it in a new AutoParallel"
            )
        if (now[0] is not was[0] or now[1] is not was[1]) and list(now) != was:
            planned = "none" if was[0] is None else fmt_strategy(was[0])  # type: ignore[arg-type]
            raise ValueError(
                f"AutoParallel: {_who(module, path)}'s sharding strategy changed after the first "
                f"call (planned with in_strategy {planned}); the plan and the parameters' storage "
                f"keep it: set strategies before the first call, or wrap the network in a new "
                f"AutoParallel"
            )
