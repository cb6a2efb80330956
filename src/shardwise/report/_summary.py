"""What one rank of a planned job holds and sends per step: the dry run's ``summary.txt``.

Everything here is computed from the `ParallelPlan` (and the optimizer-parallel plan), with no
process group and no tensor data:

- `find_optimizer`: the optimizer over a network's parameters.
- `optimizer_state_per_element`: elements of state a torch optimizer keeps per parameter
  element (Adam / AdamW 2, 3 with ``amsgrad``; SGD 1 with momentum, else 0; ...).
- `memory_tensors`: every tensor one rank holds, with its kind: parameters, gradients,
  optimizer state (each by its hsdp level), activations kept for backward, communication
  buffers; ``sw.runtime.set_memory``'s check (`runtime.check_memory`) and `estimate_memory`
  both read it (one model).
- `estimate_memory`: a `MemoryEstimate` of one rank: those kinds summed, and the peak (their
  sum: everything is held at once at the end of backward, before the step).
- `step_traffic`: the collectives of one training step with the bytes this rank sends in each:
  the forward's (as ``execute.ir`` lists them), the backward's (each forward step's adjoint:
  AllGather -> ReduceScatter, AlltoAll -> AlltoAll, an AllReduce -> an AllReduce over the
  axes on which the plan does not make its gradient equal, a local slice -> nothing; the
  plan's gradient averages), and the gradient synchronisation of the plan's gradient or
  optimizer-parallel buckets; `Traffic` sums them by collective kind and mesh axis. (The value
  a network returns counts its adjoint: a train step's returned loss has none, a few bytes.)
- `format_summary`: the text of ``summary.txt`` (with the cost model's estimate of the step
  time, `planner.step_cost`, and of one forward, `planner.plan_cost`).

The memory model per parameter of op-level block ``B`` bytes sharded ``s`` ways by optimizer
parallel (``s = 1`` when not): level 1 keeps the whole compute leaf ``B`` and its shard
``B / s``, whole gradients ``B`` (reduce-scattered at the step into ``B / s``) and state on the
shard; level 2 keeps the leaf and the shard, gradients only as shards; level 3 keeps only the
shard (the leaf is gathered for forward and again for backward: a communication buffer).
Activations: every op's local outputs, all kept (an upper bound).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from shardwise.communication.recorder import bytes_bound
from shardwise.layout import DeviceMatrix
from shardwise.optim import OptimizerPlan
from shardwise.planner import Collective, ParallelPlan, plan_cost, step_cost
from shardwise.redistribution import AllGather, AlltoAll, Slice
from shardwise.report._sends import Found, LocalSlice, edge_sends, node_sends
from shardwise.runtime import TensorEstimate, format_size

KINDS = ("parameters", "gradients", "optimizer state", "activations", "communication buffers")
"""The parts of a `MemoryEstimate`, in the order summaries and pictures stack them."""

_STATE = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1}


def optimizer_state_per_element(optimizer: torch.optim.Optimizer | None) -> int:
    """Elements of state `optimizer` keeps per parameter element (None: no optimizer, 0).

    Example:
        >>> optimizer_state_per_element(torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=0.9))
        1
    """
    if optimizer is None:
        return 0
    name = type(optimizer).__name__
    defaults = optimizer.defaults
    if name in _STATE:
        return _STATE[name] + (1 if defaults.get("amsgrad") else 0)
    if name == "SGD":
        return 1 if defaults.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(defaults.get("momentum", 0)) + bool(defaults.get("centered"))
    return 2  # (an optimizer not listed: priced like Adam)


def find_optimizer(
    network: torch.nn.Module, known: Sequence[torch.optim.Optimizer] = ()
) -> torch.optim.Optimizer | None:
    """The optimizer over `network`'s parameters: the first of `known`, else one among the
    live objects (scripts build it before their first step; a scan of the heap, so only for
    the memory check and the dry run).

    Example:
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> find_optimizer(net) is opt
        True
    """
    if known:
        return known[0]
    mine = {id(p) for p in network.parameters()}
    for obj in gc.get_objects():
        groups = obj.param_groups if isinstance(obj, torch.optim.Optimizer) else []
        if any(id(p) in mine for g in groups for p in g["params"]):
            return obj  # type: ignore[no-any-return]
    return None


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory under a plan.

    Attributes:
        rank: the rank.
        parts: bytes per kind (`KINDS`, in that order).
        largest: the largest tensors (name, bytes), largest first.
    """

    rank: int
    parts: Mapping[str, int]
    largest: tuple[tuple[str, int], ...] = ()

    @property
    def peak(self) -> int:
        """Everything held at once (the end of backward, before the optimizer's step)."""
        return sum(self.parts.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in self.parts.items())
        return f"rank {self.rank}: peak {format_size(self.peak)} ({parts})"


def estimate_memory(
    plan: ParallelPlan,
    optimizer: OptimizerPlan | None = None,
    state_per_element: int = 0,
    rank: int = 0,
) -> MemoryEstimate:
    """One rank's memory under `plan` (see the module docstring for the model).

    Args:
        plan: the op-level plan.
        optimizer: the optimizer-parallel (or gradient-bucket) plan of its parameters; None:
            every parameter whole on its op-level block, gradients likewise.
        state_per_element: `optimizer_state_per_element` of the job's optimizer.
        rank: which rank (blocks are equal on every rank; the rank is reported).

    Returns:
        The `MemoryEstimate`.

    Example:
        >>> estimate_memory(plan, state_per_element=2).peak  # doctest: +SKIP
        1048576
    """
    tensors = memory_tensors(plan, optimizer, state_per_element)
    parts = dict.fromkeys(KINDS, 0)
    for t in tensors:
        parts[t.kind] += t.nbytes
    largest = sorted(tensors, key=lambda t: -t.nbytes)[:3]
    return MemoryEstimate(rank, parts, tuple((t.name, t.nbytes) for t in largest))


def memory_tensors(
    plan: ParallelPlan, optimizer: OptimizerPlan | None = None, state_per_element: int = 0
) -> list[TensorEstimate]:
    """Every tensor one rank holds under `plan`, each with its kind (`KINDS`): the model of
    the module docstring, which `estimate_memory` sums and ``sw.runtime.set_memory`` checks
    (`runtime.check_memory`) before anything is allocated.

    Example:
        >>> [t.kind for t in memory_tensors(plan)][:2]  # doctest: +SKIP
        ['parameters', 'gradients']
    """
    level = optimizer.config.optimizer_level if optimizer is not None else "level1"
    out: list[TensorEstimate] = []
    gathered = 0
    for name, p in plan.params.items():
        dtype = getattr(torch, p.dtype)
        block = p.layout.local_shape(p.shape)
        shard = _shard_of(optimizer, name)
        piece = (block[0] // shard, *block[1:]) if shard > 1 else block
        if not (shard > 1 and level == "level3"):
            out.append(TensorEstimate(name, block, dtype, "parameters"))
        if shard > 1:
            out.append(TensorEstimate(f"{name} (shard)", piece, dtype, "parameters"))
        if dtype.is_floating_point:
            grad = piece if shard > 1 and level != "level1" else block
            out.append(TensorEstimate(f"{name}.grad", grad, dtype, "gradients"))
            if state_per_element:
                state = (state_per_element, *piece)
                out.append(
                    TensorEstimate(f"{name} optimizer state", state, dtype, "optimizer state")
                )
        if shard > 1 and level == "level3":
            gathered = max(gathered, math.prod(block) * dtype.itemsize)
    for n in plan.nodes:
        for k, local in enumerate(n.local_shapes):
            dtype = getattr(torch, n.dtype(k))
            out.append(TensorEstimate(f"{n.name} output {k}", local, dtype, "activations"))
    buffers = [
        ("the largest fused bucket", _bucket_bytes(plan, optimizer)),
        ("the largest value an edge moves", _moved_bytes(plan)),
        ("the largest parameter gathered (level 3)", gathered),
    ]
    for what, nbytes in buffers:
        if nbytes:
            out.append(TensorEstimate(what, (nbytes,), torch.uint8, "communication buffers"))
    return out


def _shard_of(optimizer: OptimizerPlan | None, name: str) -> int:
    if optimizer is None:
        return 1
    try:
        return optimizer.param(name).shard
    except KeyError:
        return 1


def _bucket_bytes(plan: ParallelPlan, optimizer: OptimizerPlan | None) -> int:
    """The largest fused bucket (gathered weights or reduced gradients): the plan's own
    buckets (`ParallelPlan.buckets`), else `optimizer`'s."""
    if optimizer is not None and not plan.buckets:
        sizes = {p.info.name: p.info.block_bytes for p in optimizer.params}
        return max((sum(sizes[n] for n in b.names) for b in optimizer.buckets), default=0)
    blocks = _param_blocks(plan)
    return max((sum(blocks[n] for n in b.params) for b in plan.buckets), default=0)


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def _param_blocks(plan: ParallelPlan) -> dict[str, int]:
    """Parameter -> bytes of this rank's op-level block."""
    return {
        name: math.prod(p.layout.local_shape(p.shape)) * _itemsize(p.dtype)
        for name, p in plan.params.items()
    }


def _moved_bytes(plan: ParallelPlan) -> int:
    """The largest value an edge moves (its destination block, held beside the source while
    the collective runs)."""
    moved = 0
    m = plan.matrix
    for e in plan.edges:
        sends = [s for s in e.steps if not isinstance(s, Slice) and m.shape[s.axis] > 1]
        if sends or e.reduced:  # (a local slice alone needs no buffer)
            moved = max(moved, math.prod(e.dst.layout.local_shape(e.shape)) * _itemsize(e.dtype))
    return moved


@dataclass
class Traffic:
    """Bytes this rank sends per step and collective counts, by (phase, kind, mesh axes)."""

    sent: dict[tuple[str, str, str], int] = field(default_factory=dict)
    count: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def add(self, phase: str, c: Collective, nbytes: int) -> None:
        key = (phase, c.kind, ",".join(c.axes))
        self.sent[key] = self.sent.get(key, 0) + nbytes
        self.count[key] = self.count.get(key, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def step_traffic(plan: ParallelPlan, rank: int, optimizer: OptimizerPlan | None) -> Traffic:
    """The collectives of one training step on `rank` (see the module docstring).

    Args:
        plan: the plan (its `ParallelPlan.buckets`: the gradient or optimizer-parallel
            buckets).
        rank: the rank whose bytes are counted.
        optimizer: the optimizer-parallel plan (its hsdp level: level 3 gathers the weights
            again in backward); None: level 1.

    Returns:
        The `Traffic`.

    Example:
        >>> step_traffic(plan, 0, None).total  # doctest: +SKIP
        6144
    """
    out = Traffic()
    m = plan.matrix
    for e in plan.edges:
        for item in edge_sends(e, rank):
            if isinstance(item, LocalSlice):
                continue
            c, _, sent = item
            out.add("forward", c, sent)
            if c.kind == "AllReduce":  # (its adjoint, over the axes the plan leaves unequal)
                block = math.prod(e.src.layout.local_shape(e.shape)) * _itemsize(e.dtype)
                _adjoint(out, m, rank, c, e.reduced, e.equal_grad, block)
            elif c.kind in (AllGather.__name__, AlltoAll.__name__):  # (their exact adjoints)
                back = "ReduceScatter" if c.kind == "AllGather" else "AlltoAll"
                out.add("backward", Collective(back, c.axes, c.where), sent)
    for n in plan.nodes:
        for c, _, sent in _collectives(node_sends(n, m, rank)):
            out.add("forward", c, sent)
            axes = tuple(m.names.index(a) for a in c.axes)
            if c.kind == "AllReduce":
                equal = tuple(m.names.index(a) for a in c.equal_grad)
                block = math.prod(n.local_shapes[c.output]) * _itemsize(n.dtype(c.output))
                _adjoint(out, m, rank, c, axes, equal, block)
            elif c.kind == "ReduceScatter":
                out.add("backward", Collective("AllGather", c.axes, c.where), sent)
        for c in n.backward:
            size = len(m.group_along(rank, tuple(m.names.index(a) for a in c.axes)))
            nbytes = math.prod(n.local_shapes[c.output]) * _itemsize(n.dtype(c.output))
            out.add("backward", c, bytes_bound(c.kind, nbytes, size))
    level = optimizer.config.optimizer_level if optimizer is not None else "level1"
    _gradient_sync(out, plan, level)
    return out


def _adjoint(
    out: Traffic,
    m: DeviceMatrix,
    rank: int,
    c: Collective,
    axes: Sequence[int],
    equal: Sequence[int],
    nbytes: int,
) -> None:
    """The backward of an AllReduce over `axes` of an `nbytes` block: an AllReduce of the
    gradient over the axes on which the plan does not make it equal (`equal`)."""
    rest = tuple(a for a in axes if a not in equal)
    if not rest:
        return
    size = len(m.group_along(rank, rest))
    names = tuple(m.names[a] for a in rest)
    out.add(
        "backward", Collective("AllReduce", names, c.where), bytes_bound("AllReduce", nbytes, size)
    )


def _collectives(found: Iterable[Found]) -> list[tuple[Collective, list[int], int]]:
    return [item for item in found if not isinstance(item, LocalSlice)]


def _gradient_sync(out: Traffic, plan: ParallelPlan, level: str) -> None:
    """Each bucket of the plan's (`ParallelPlan.buckets`): an AllReduce of the gradients over
    its data-parallel axes, or (optimizer parallel) an AllGather of the weights per forward
    (and again in backward at level 3) and a ReduceScatter of the gradients over the shard
    group (then an AllReduce over the copies when the shard group is smaller than the
    data-parallel group)."""
    m = plan.matrix
    sizes = _param_blocks(plan)
    for b in plan.buckets:
        group = math.prod(m.shape[m.names.index(a)] for a in b.axes)
        total = sum(sizes[n] for n in b.params)
        if not b.axes or group <= 1:
            continue
        if b.kind == "allreduce":
            out.add("gradients", Collective("AllReduce", b.axes, "bucket"), _ar(total, group))
            continue
        gathers = 2 if level == "level3" else 1
        for _ in range(gathers):
            sent = bytes_bound("AllGather", total // b.shard, b.shard)
            out.add("weights", Collective("AllGather", b.axes, "bucket"), sent)
        sent = bytes_bound("ReduceScatter", total, b.shard)
        out.add("gradients", Collective("ReduceScatter", b.axes, "bucket"), sent)
        if group > b.shard:
            sent = _ar(total // b.shard, group // b.shard)
            out.add("gradients", Collective("AllReduce", b.axes, "bucket copies"), sent)


def _ar(nbytes: int, group: int) -> int:
    return bytes_bound("AllReduce", nbytes, group)


def format_summary(
    plan: ParallelPlan,
    memory: MemoryEstimate,
    traffic: Traffic,
    header: Sequence[str] = (),
) -> str:
    """The text of ``summary.txt``: memory per kind and the peak, bytes sent per step by
    phase / collective kind / mesh axes with counts, and the step and forward estimates."""
    lines = list(header)
    lines.append(f"plan: {plan.mode}, {plan.device_num} devices on {plan.matrix}")
    lines.append(f"ops: {len(plan.nodes)}, parameters: {len(plan.params)}")
    lines.append("")
    lines.append(f"memory of rank {memory.rank} (estimate):")
    for kind, nbytes in memory.parts.items():
        lines.append(f"  {kind:<22} {format_size(nbytes):>12}  ({nbytes} B)")
    lines.append(f"  {'peak':<22} {format_size(memory.peak):>12}  ({memory.peak} B)")
    for name, nbytes in memory.largest:
        lines.append(f"  largest: {name} {format_size(nbytes)}")
    lines.append("")
    lines.append(f"bytes rank {memory.rank} sends per step: {traffic.total}")
    lines.append(f"  {'phase':<10} {'collective':<14} {'axes':<12} {'count':>6} {'bytes':>14}")
    for key in sorted(traffic.sent):
        phase, kind, axes = key
        lines.append(
            f"  {phase:<10} {kind:<14} {axes or '-':<12} {traffic.count[key]:>6} "
            f"{traffic.sent[key]:>14}"
        )
    lines.append("")
    lines.append(f"step estimate (cost model, one training step): {step_cost(plan)}")
    lines.append(f"  of which one forward (the search's objective): {plan_cost(plan)}")
    return "\n".join(lines) + "\n"
