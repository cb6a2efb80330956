"""What one rank of a planned job holds at its peak: the memory model of ``summary.txt``,
``sw.runtime.set_memory`` and the plan pictures (one model, computed from the `ParallelPlan`
and the optimizer-parallel plan, with no process group and no tensor data).

- `find_optimizer`: the optimizer over a network's parameters.
- `optimizer_state_per_element`: elements of state a torch optimizer keeps per parameter
  element (Adam / AdamW 2, 3 with ``amsgrad``; SGD 1 with momentum, else 0; ...).
- `memory_tensors`: every tensor one rank holds at its peak, each with its kind (`KINDS`);
  ``sw.runtime.set_memory``'s check (`runtime.check_memory`) and `estimate_memory` both read
  it.
- `estimate_memory`: a `MemoryEstimate`: those tensors summed by kind, the peak, and the
  moment of the step it happens at.

The model. At rest (between steps) a rank holds, per parameter of op-level block ``B`` bytes
sharded ``s`` ways by optimizer parallel (``s = 1`` when not): levels 1-2 the compute leaf
``B`` and the shard ``B / s`` (the leaf is kept from step to step and gathered into in place),
level 3 only the shard; the optimizer's state, ``k · B / s`` (none for a frozen parameter,
`ParallelPlan.frozen`: it gets no gradient); and on gloo the packed message
buffers the pairwise transport's pool keeps (``_pool``: per message length, the most out at
once during a step; every packed message of a step reuses them, so no moment adds them
again). A step adds, at one of three moments, whichever is largest:

- ``start of backward``: every op output that owns its storage (a view, reshape, transpose or split
  shares its input's) is still held for backward, plus the gradient of the largest one that gets a
  gradient (`ParallelPlan.gradient_values`; the first the backward makes), the largest value an edge
  moves, and at level 3 the gathered weights of every shard bucket (the forward frees them only once
  it is done);
- ``gradient reduction``: every trainable parameter's whole gradient ``B`` (level 1 keeps them until
  the optimizer's step; at levels 2-3 each bucket's reduction is started in backward and finished at
  its end, so its whole gradients live until then) and the reduction's buffers (the shard buckets'
  ``B``: received pieces and the reduced shard);
- ``optimizer step``: the trainable parameters' reduced gradients (``B / s``) and the optimizer's
  temporaries (an Adam-like update makes two of the largest parameter's shard).

The moment that needs most is the peak. Measured against 4 real ranks by
``bench/memory.py`` (``report.MemoryMeter``: torch's allocator) and
``tests/multiprocess/test_memory_estimate_real.py``.
"""

from __future__ import annotations

import gc
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shardwise.optim import OptimizerPlan
from shardwise.planner import ParallelPlan, Ref, regathered_params
from shardwise.redistribution import Slice
from shardwise.report._pool import Key, pooled_buffers, split_at_pool
from shardwise.runtime import TensorEstimate, format_size

KINDS = ("parameters", "gradients", "optimizer state", "activations", "communication buffers")
"""The parts of a `MemoryEstimate`, in the order summaries and pictures stack them."""

_STATE = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1}
_VIEWS = frozenset(
    [
        "view",
        "view_as",
        "reshape",
        "flatten",
        "unflatten",
        "transpose",
        "t",
        "permute",
        "split",
        "chunk",
        "unbind",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "narrow",
        "select",
        "contiguous",
        "Reshape",
        "Flatten",
        "Transpose",
        "ExpandDims",
        "Squeeze",
        "Split",
    ]
)
"""Ops whose outputs share their input's storage (the last part of the op's name)."""


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
        # (type(), not isinstance: that reads `__class__`, and some objects warn on any read)
        groups = obj.param_groups if issubclass(type(obj), torch.optim.Optimizer) else []
        if any(id(p) in mine for g in groups for p in g["params"]):
            return obj  # type: ignore[no-any-return]
    return None


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory at its peak under a plan.

    Attributes:
        rank: the rank.
        parts: bytes per kind (`KINDS`, in that order) held at the peak.
        largest: the largest tensors (name, bytes), largest first.
        moment: when in the step the peak is (``"start of backward"``, ``"gradient
            reduction"`` or ``"optimizer step"``).
    """

    rank: int
    parts: Mapping[str, int]
    largest: tuple[tuple[str, int], ...] = ()
    moment: str = ""

    @property
    def peak(self) -> int:
        """Everything held at once at `moment`."""
        return sum(self.parts.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in self.parts.items())
        return f"rank {self.rank}: peak {format_size(self.peak)} at {self.moment} ({parts})"


def estimate_memory(
    plan: ParallelPlan,
    optimizer: OptimizerPlan | None = None,
    state_per_element: int = 0,
    rank: int = 0,
) -> MemoryEstimate:
    """One rank's peak memory under `plan` (see the module docstring for the model).

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
    moment, tensors = _peak(plan, optimizer, state_per_element)
    parts = dict.fromkeys(KINDS, 0)
    for t in tensors:
        parts[t.kind] += t.nbytes
    largest = sorted(tensors, key=lambda t: -t.nbytes)[:3]
    return MemoryEstimate(rank, parts, tuple((t.name, t.nbytes) for t in largest), moment)


def memory_tensors(
    plan: ParallelPlan, optimizer: OptimizerPlan | None = None, state_per_element: int = 0
) -> list[TensorEstimate]:
    """Every tensor one rank holds at its peak under `plan`, each with its kind (`KINDS`): the
    model of the module docstring, which `estimate_memory` sums and ``sw.runtime.set_memory``
    checks (`runtime.check_memory`) before anything is allocated.

    Example:
        >>> [t.kind for t in memory_tensors(plan)][:2]  # doctest: +SKIP
        ['parameters', 'optimizer state']
    """
    return _peak(plan, optimizer, state_per_element)[1]


def _peak(
    plan: ParallelPlan, optimizer: OptimizerPlan | None, k: int
) -> tuple[str, list[TensorEstimate]]:
    """The moment of the step that holds most, and the tensors held then."""
    kept, made = _message_buffers(*split_at_pool(_pooled(plan, optimizer)))
    rest = _at_rest(plan, optimizer, k) + kept
    moments = {
        "start of backward": _backward_start(plan, optimizer),
        "gradient reduction": _reduction(plan, optimizer) + made,
        "optimizer step": _optimizer_step(plan, optimizer, k),
    }
    moment = max(moments, key=lambda m: sum(t.nbytes for t in moments[m]))
    return moment, rest + moments[moment]


@dataclass(frozen=True)
class _Param:
    name: str
    dtype: torch.dtype
    block: tuple[int, ...]
    piece: tuple[int, ...]  # (its shard; the block when not sharded)

    @property
    def sharded(self) -> bool:
        return self.piece != self.block

    @property
    def piece_bytes(self) -> int:
        return math.prod(self.piece) * self.dtype.itemsize


def _params(plan: ParallelPlan, optimizer: OptimizerPlan | None) -> list[_Param]:
    out = []
    for name, p in plan.params.items():
        block = tuple(p.layout.local_shape(p.shape))
        shard = _shard_of(optimizer, name)
        piece = (block[0] // shard, *block[1:]) if shard > 1 else block
        out.append(_Param(name, getattr(torch, p.dtype), block, piece))
    return out


def _level(optimizer: OptimizerPlan | None) -> str:
    return optimizer.config.optimizer_level if optimizer is not None else "level1"


def _at_rest(plan: ParallelPlan, optimizer: OptimizerPlan | None, k: int) -> list[TensorEstimate]:
    """Parameters (levels 1-2: leaf and shard; level 3: the shard) and optimizer state."""
    level3 = _level(optimizer) == "level3"
    out = []
    for p in _params(plan, optimizer):
        if not (p.sharded and level3):
            out.append(TensorEstimate(p.name, p.block, p.dtype, "parameters"))
        if p.sharded:
            out.append(TensorEstimate(f"{p.name} (shard)", p.piece, p.dtype, "parameters"))
        if k and p.dtype.is_floating_point and p.name not in plan.frozen:
            state = (k, *p.piece)
            out.append(
                TensorEstimate(f"{p.name} optimizer state", state, p.dtype, "optimizer state")
            )
    return out


def _message_buffers(kept: int, beyond: int) -> tuple[list[TensorEstimate], list[TensorEstimate]]:
    """The packed message buffers of the pairwise transport (``_pool``): (those its pool keeps
    from step to step, held at rest: every packed message of a step reuses them; those beyond
    ``POOL_BYTES``, made during the step: at the gradient reduction)."""
    kinds = "communication buffers"
    rest = [TensorEstimate("pooled message buffers", (kept,), torch.uint8, kinds)] if kept else []
    made = [TensorEstimate("message buffers beyond the pool", (beyond,), torch.uint8, kinds)]
    return rest, made if beyond else []


def _pooled(plan: ParallelPlan, optimizer: OptimizerPlan | None) -> Counter[Key]:
    if optimizer is None:
        return Counter()
    params = _params(plan, optimizer)
    pieces = {p.name: (math.prod(p.piece), p.dtype) for p in params}
    shard = [b for b in optimizer.buckets if b.kind == "shard"]
    saved = regathered_params(plan)  # (gathered again in backward at level 3)
    keep = [k for k, b in enumerate(shard) if saved.intersection(b.names)]
    return pooled_buffers(optimizer, pieces, keep)


def _backward_start(plan: ParallelPlan, optimizer: OptimizerPlan | None) -> list[TensorEstimate]:
    """Outputs held for backward, the first gradient, an edge's buffer, level 3's gathers."""
    out, graded = [], []
    needs = plan.gradient_values()
    for n in plan.nodes:
        if n.op.rsplit(".", 1)[-1] in _VIEWS:
            continue
        for i, local in enumerate(n.local_shapes):
            dtype = getattr(torch, n.dtype(i))
            out.append(TensorEstimate(f"{n.name} output {i}", local, dtype, "activations"))
            if str(Ref("node", n.index, i)) in needs:
                graded.append(out[-1])
    if graded:
        first = max(graded, key=lambda t: t.nbytes)
        out.append(
            TensorEstimate(f"gradient of {first.name}", first.shape, first.dtype, "gradients")
        )
    moved = _moved_bytes(plan)
    if moved:
        out.append(TensorEstimate("the largest value an edge moves", (moved,), torch.uint8,
                                  "communication buffers"))  # fmt: skip
    if _level(optimizer) == "level3":
        for p in _params(plan, optimizer):
            if p.sharded:
                what = f"{p.name} (gathered, level 3)"
                out.append(TensorEstimate(what, p.block, p.dtype, "communication buffers"))
    return out


def _reduction(plan: ParallelPlan, optimizer: OptimizerPlan | None) -> list[TensorEstimate]:
    """Whole gradients of every trainable parameter and the shard buckets' reduction
    buffers."""
    out = []
    for p in _params(plan, optimizer):
        if p.dtype.is_floating_point and p.name not in plan.frozen:
            out.append(TensorEstimate(f"{p.name}.grad", p.block, p.dtype, "gradients"))
            if p.sharded:
                what = f"{p.name} reduction buffers"
                out.append(TensorEstimate(what, p.block, p.dtype, "communication buffers"))
    return out


def _optimizer_step(
    plan: ParallelPlan, optimizer: OptimizerPlan | None, k: int
) -> list[TensorEstimate]:
    """Reduced gradients and an Adam-like update's two temporaries of the largest shard."""
    params = [
        p
        for p in _params(plan, optimizer)
        if p.dtype.is_floating_point and p.name not in plan.frozen
    ]
    out = [TensorEstimate(f"{p.name}.grad", p.piece, p.dtype, "gradients") for p in params]
    if k >= 2 and params:
        big = max(params, key=lambda p: math.prod(p.piece) * p.dtype.itemsize)
        out.append(TensorEstimate(f"{big.name} update temporaries", (2, *big.piece), big.dtype,
                                  "optimizer state"))  # fmt: skip
    return out


def _shard_of(optimizer: OptimizerPlan | None, name: str) -> int:
    if optimizer is None:
        return 1
    try:
        return optimizer.param(name).shard
    except KeyError:
        return 1


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


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
