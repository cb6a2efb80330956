"""The plan of data-parallel mode (`DataParallelRunner`): which rank updates each parameter,
and which parameters share one collective.

`plan_entries` and `plan_buckets` build it, in the runner's constructor:

- `plan_entries`: one `ParamEntry` per network parameter that requires a gradient, in order:
  the optimizer holding it (`optimizer_of`, which also refuses a parameter held by two
  optimizers or not the network's), its ``comm_fusion`` id, whether it is the weight of an
  ``nn.Embedding`` / ``nn.EmbeddingBag`` built with ``sparse=True`` (its gradient is sparse:
  no slot in the flat buffer), and with ``parallel_optimizer=True`` its owner rank
  (`assign_owners`: a greedy byte balance over the parameters that allow it and hold at least
  the threshold).
- `param_ids`: the parameters an optimizer holds; `apart`: without optimizer parallel, the
  known optimizers less those over exactly the parameters of an earlier one (taken when they
  first step);
- `check_arguments`, `check_optimizers`: the runner's argument types and values;
  `find_optimizers`: the optimizers a train step's code names; `materialized`: a network
  built in ``sw.no_init_parameters()`` given its values on every rank before the plan.
- `plan_buckets`: per optimizer, the gradient all-reduce buckets (`grad_buckets`: by fusion id,
  size or index split points) and the parameter broadcast buckets (`broadcast_buckets`: one per
  owner and fusion id), each a `CommBucket`; `plan_table`: the plan as the runner prints it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.optim._settings import FusionConfig, check_points
from shardwise.parameter import comm_fusion_of, parallel_optimizer_of

WHO = "DataParallelRunner"


@dataclass
class ParamEntry:
    """One parameter of the plan."""

    name: str
    param: nn.Parameter
    optimizer: int | None
    owner: int | None = None
    fusion: int = 1
    index: int = 0  # position among the network's parameters (``index`` fusion split points)
    grad_bucket: int | None = None
    broadcast_bucket: int | None = None
    sparse: bool = False  # an ``nn.Embedding`` / ``nn.EmbeddingBag(sparse=True)`` weight

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()


@dataclass
class CommBucket:
    """Parameters sharing one collective (`root` is the broadcast's owner rank)."""

    index: int
    entries: list[ParamEntry] = field(default_factory=list)
    root: int | None = None


def assign_owners(sizes: Sequence[int | None], world: int) -> list[int | None]:
    """Greedy byte balance: each sized item, in order, goes to the rank with the fewest bytes so
    far (the lowest such rank on ties); None items get no owner.

    Args:
        sizes: bytes of each parameter, or None for one every rank updates.
        world: the number of ranks.

    Returns:
        The owner rank of each item (None where `sizes` is None).

    Example:
        >>> assign_owners([400, None, 300, 200, 100], 2)
        [0, None, 1, 1, 0]
    """
    load = [0] * world
    out: list[int | None] = []
    for size in sizes:
        if size is None:
            out.append(None)
            continue
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += size
        out.append(owner)
    return out


def grad_buckets(entries: list[ParamEntry], config: FusionConfig, start: int) -> list[CommBucket]:
    """Buckets of one optimizer's parameters (in parameter order) for the gradient all-reduce.

    By fusion id unless `config` (``optim.check_fusion``) buckets ``allreduce`` by ``size`` /
    ``auto`` (consecutive parameters up to the cap) or ``index`` (a new bucket at each split
    point, a network parameter index); fusion id 0 alone; fusion off (``openstate`` False): one
    per parameter. A bucket holds one dtype and device only.
    """
    cap = config.bucket_bytes("allreduce")
    points = config.split_points("allreduce")
    buckets: list[CommBucket] = []
    by_key: dict[tuple[object, ...], CommBucket] = {}
    size = 0
    for e in entries:
        kind = (e.param.dtype, e.param.device)
        last = buckets[-1] if buckets else None
        same = last is not None and (last.entries[0].param.dtype, last.entries[0].param.device)
        bucket: CommBucket | None
        if not config.enabled:
            bucket = None
        elif cap is not None:
            bucket = last if size + e.nbytes <= cap and same == kind else None
        elif points is not None:
            bucket = last if e.index not in points and same == kind else None
        else:
            bucket = None if e.fusion == 0 else by_key.get((e.fusion, *kind))
        if bucket is None:
            bucket = CommBucket(start + len(buckets))
            buckets.append(bucket)
            by_key[(e.fusion, *kind)] = bucket
            size = 0
        bucket.entries.append(e)
        size += e.nbytes
        e.grad_bucket = bucket.index
    return buckets


def broadcast_buckets(entries: list[ParamEntry], fused: bool, start: int) -> list[CommBucket]:
    """One bucket per (owner, fusion id, dtype, device) of one optimizer's owned parameters, in
    parameter order; fusion id 0 (or fusion off): one per parameter."""
    buckets: list[CommBucket] = []
    by_key: dict[tuple[object, ...], CommBucket] = {}
    for e in entries:
        if e.owner is None:
            continue
        key = (e.owner, e.fusion, e.param.dtype, e.param.device)
        bucket = by_key.get(key) if fused and e.fusion != 0 else None
        if bucket is None:
            bucket = CommBucket(start + len(buckets), root=e.owner)
            buckets.append(bucket)
            by_key[key] = bucket
        bucket.entries.append(e)
        e.broadcast_bucket = bucket.index
    return buckets


def optimizer_of(network: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, int]:
    """``id(parameter)`` -> the index of the optimizer holding it.

    Raises:
        ValueError: a parameter held by two optimizers, or an optimizer holding a parameter
            that is not one of `network`'s.
    """
    where: dict[int, int] = {}
    for i, o in enumerate(optimizers):
        for group in o.param_groups:
            for p in group["params"]:
                if id(p) in where:
                    raise ValueError(
                        f"{WHO}: a parameter of shape {list(p.shape)} is held by "
                        f"optimizers[{where[id(p)]}] and optimizers[{i}]; give each "
                        "parameter to one optimizer"
                    )
                where[id(p)] = i
    mine = {id(p) for p in network.parameters()}
    for i, o in enumerate(optimizers):
        for group in o.param_groups:
            for p in group["params"]:
                if id(p) not in mine:
                    raise ValueError(
                        f"{WHO}: optimizers[{i}] ({type(o).__name__}) holds a parameter of "
                        f"shape {list(p.shape)} that is not one of the network's; build the "
                        "optimizer over network.parameters() (after world.replicate(network)"
                        " in a simulated world)"
                    )
    return where


def plan_entries(
    network: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    parallel_optimizer: bool,
    threshold_kb: float,
    world: int,
) -> list[ParamEntry]:
    """One entry per parameter of `network` that requires a gradient, in parameter order, with
    its optimizer, fusion id and (``parallel_optimizer=True``) owner rank.

    Raises:
        ValueError: as `optimizer_of`.
    """
    where = optimizer_of(network, optimizers)
    kinds = (nn.Embedding, nn.EmbeddingBag)
    sparse = {id(m.weight) for m in network.modules() if isinstance(m, kinds) and m.sparse}
    entries = [
        ParamEntry(
            n, p, where.get(id(p)), fusion=comm_fusion_of(p), index=k, sparse=id(p) in sparse
        )
        for k, (n, p) in enumerate(network.named_parameters())
        if p.requires_grad
    ]
    threshold = threshold_kb * 1024
    sizes = [
        e.nbytes
        if parallel_optimizer
        and e.optimizer is not None
        and parallel_optimizer_of(e.param)
        and e.nbytes >= threshold
        else None
        for e in entries
    ]
    for e, owner in zip(entries, assign_owners(sizes, world), strict=True):
        e.owner = owner
    return entries


def plan_buckets(
    entries: list[ParamEntry], n_optimizers: int, fusion: FusionConfig
) -> tuple[list[list[CommBucket]], list[list[CommBucket]]]:
    """Per optimizer, its gradient all-reduce buckets and its broadcast buckets (numbered
    across the optimizers, in order; each entry gets its buckets' indices)."""
    grads_out: list[list[CommBucket]] = []
    bcasts_out: list[list[CommBucket]] = []
    n_grad = n_bcast = 0
    check_points(fusion.split_points("allreduce"), 1 + max((e.index for e in entries), default=-1))
    for i in range(n_optimizers):
        mine = [e for e in entries if e.optimizer == i]
        grads = grad_buckets(mine, fusion, n_grad)
        bcasts = broadcast_buckets(mine, fusion.enabled, n_bcast)
        n_grad, n_bcast = n_grad + len(grads), n_bcast + len(bcasts)
        grads_out.append(grads)
        bcasts_out.append(bcasts)
    return grads_out, bcasts_out


def plan_table(entries: list[ParamEntry]) -> list[str]:
    """The plan's table, one line per parameter under a header: shape, bytes, owner (``all``:
    every rank updates it; ``-``: no optimizer), fusion id, gradient and broadcast buckets."""
    rows = [("parameter", "shape", "bytes", "owner", "fusion", "allreduce", "broadcast")]
    for e in entries:
        rows.append(
            (
                e.name,
                str(list(e.param.shape)),
                str(e.nbytes),
                "-" if e.optimizer is None else ("all" if e.owner is None else str(e.owner)),
                str(e.fusion),
                "-" if e.grad_bucket is None else f"#{e.grad_bucket}",
                "-" if e.broadcast_bucket is None else f"#{e.broadcast_bucket}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return [line.rstrip() for line in lines]


def check_arguments(
    network: Any, train_step: Any, parallel_optimizer: Any, threshold_kb: Any, strategy: Any
) -> None:
    """`DataParallelRunner`'s argument types and values (the errors its docstring lists).

    Raises:
        TypeError / ValueError: as `DataParallelRunner` lists them.
    """
    if strategy not in ("data_parallel", "full_batch"):
        raise ValueError(
            f"{WHO}: dataset_strategy={strategy!r}; parallel_mode='data_parallel' "
            "takes 'data_parallel' (each rank passes its own rows of the global batch) or "
            "'full_batch' (each rank passes the whole global batch); per-input strategies "
            "need parallel_mode='semi_auto'"
        )
    if not isinstance(network, nn.Module):
        raise TypeError(f"{WHO}: network must be a torch.nn.Module, got {type(network)}")
    if train_step is not None and not callable(train_step):
        raise TypeError(f"{WHO}: train_step must be callable or None, got {train_step!r}")
    if not isinstance(parallel_optimizer, bool):
        raise TypeError(f"{WHO}: parallel_optimizer={parallel_optimizer!r} must be a bool")
    if (
        isinstance(threshold_kb, bool)
        or not isinstance(threshold_kb, int | float)
        or not threshold_kb >= 0
    ):
        raise ValueError(
            f"{WHO}: threshold_kb={threshold_kb!r} must be a number of KiB >= 0 "
            "(0: every parameter that allows it gets an owner)"
        )


def find_optimizers(train_step: Callable[..., Any]) -> list[torch.optim.Optimizer]:
    """The optimizers `train_step`'s code refers to."""
    from shardwise.parallel._discover import find_referenced  # lazy: parallel may import optim

    return find_referenced(train_step)[1]


def materialized(network: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give a network built in ``sw.no_init_parameters()`` its whole values on every rank now
    (a rank may get new parameter objects: `optimizers` are pointed at them), so the plan is
    made over the parameters the steps train."""
    from shardwise.parallel._delayed import materialize_whole  # lazy: parallel imports optim

    materialize_whole(network, optimizers)


def param_ids(opt: torch.optim.Optimizer, trainable: bool = False) -> set[int]:
    """The ids of the parameters `opt`'s groups hold (`trainable`: those requiring gradients)."""
    return {
        id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad or not trainable
    }


def apart(opts: Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """`opts` without those over exactly the parameters of an earlier one (without optimizer
    parallel): such an optimizer, known from the start (SGD for a warm-up, then Adam over the
    same parameters, both named in the train step), is taken when it first steps, replacing
    the other (`_data_parallel_hooks.replaced`), whichever order the code names them in. Two
    that share only some parameters stay, for `plan_entries` to refuse."""
    kept: list[torch.optim.Optimizer] = []
    sets: list[set[int]] = []
    for o in opts:
        mine = param_ids(o)
        if mine not in sets:
            kept.append(o)
            sets.append(mine)
    return kept


def check_optimizers(opts: Sequence[Any], parallel_optimizer: bool, with_step: bool) -> None:
    """Raise TypeError for an optimizer that is not a ``torch.optim.Optimizer`` (or is
    ``torch.optim.LBFGS`` with ``parallel_optimizer=True``), ValueError for
    ``parallel_optimizer=True`` without one (`with_step`: a train step was searched)."""
    for i, o in enumerate(opts):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"{WHO}: optimizers[{i}] is a {type(o).__name__}, not a "
                "torch.optim.Optimizer; pass the optimizers built over network.parameters()"
            )
    if parallel_optimizer and any(isinstance(o, torch.optim.LBFGS) for o in opts):
        raise TypeError(
            f"{WHO}: torch.optim.LBFGS cannot step under optimizer parallel (hsdp() / "
            "parallel_optimizer=True): each rank would update only the parameters it owns, and "
            "LBFGS's line search branches on dot products and norms over all of them; train "
            "without hsdp() (LBFGS works there), or use another optimizer"
        )
    if parallel_optimizer and not opts:
        raise ValueError(
            f"{WHO}: optimizer parallel (AutoParallel(..., parallel_mode='data_parallel')"
            ".hsdp(), or parallel_optimizer=True) needs the optimizer before the first call, but "
            "none was passed"
            + (" or found in the train step's code" if with_step else "")
            + ": build it before the wrapper and pass it (AutoParallel(..., optimizer=opt), "
            "DataParallelRunner(..., optimizers=[opt])), or let the step's code name it "
            "directly, not through a dict or list"
        )
