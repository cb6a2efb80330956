"""Helpers shared by the benchmarks that compare training steps or collectives side by side.

Used by ``bench.manual_dp``, ``bench.operator_parallel``, ``bench.gpt_block``,
``bench.optimizer_parallel`` (and partly ``bench.collectives``); the process / timing / table
machinery itself is ``bench.harness``.

- In the parent: `ranks_for` (the N to run, default `DEFAULT_RANKS`), `jobs` (one gloo job per
  N with the ``[bench]`` progress lines), `report_meta` (the ``meta`` of the saved JSON), and
  for the tables `n_label`, `ratio`, `paired` (a paired ratio with its interval, as JSON),
  `oversubscribed_notes` and `calls_text`.
- In the workers: `chunk` (several steps per timed call), `fastest_threads` (the one-process
  baseline's thread count), `exit_quietly` (skip a crash-prone interpreter finalization),
  `sw_accounting` (shardwise's collectives under `CommRecorder`) and `torch_accounting` (the
  c10d collectives of a PyTorch step seen by a ``TorchDispatchMode``, `spy_mode`).
- Shardwise vs DTensor (``bench.operator_parallel``, ``bench.gpt_block``): `TPResult` (the
  fields both records share; `TPResult.sw_dt` is their paired step-time ratio),
  `tp_accounting` (their communication fields) and `check_three` (fresh shardwise / DTensor /
  one-process copies trained side by side: the loss and parameter differences).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from bench.harness import BenchConfig, Measurement, Ratio, host_info, paired_ratio, spawn

if TYPE_CHECKING:
    import torch

    from shardwise.communication import CommRecorder

DEFAULT_RANKS = (2, 4)
OVERSUBSCRIBED = (
    "* more workers than the {cores} cores: time-sliced processes; these times measure "
    "scheduling as much as communication, never report them as speed-ups"
)
CALLS_HEADER = "Collectives of one step, in order (kind(phase)[elements per rank]):"
Step = Callable[[], object]


class _Row(Protocol):
    world_size: int
    oversubscribed: bool


# --------------------------------------------------------------------------- the parent


def ranks_for(config: BenchConfig, invalid: Callable[[int], bool], message: str) -> tuple[int, ...]:
    """`DEFAULT_RANKS` for the default ``--ranks``, otherwise ``--ranks``; `ValueError` with
    ``message.format(bad=[...])`` when some N is `invalid`."""
    ranks = DEFAULT_RANKS if config.ranks == BenchConfig().ranks else config.ranks
    bad = [n for n in ranks if invalid(n)]
    if bad:
        raise ValueError(message.format(bad=bad))
    return ranks


def jobs(
    name: str, config: BenchConfig, ranks: Iterable[int], args: dict[str, Any]
) -> Iterator[tuple[int, list[Any]]]:
    """One ``bench.<name>:worker`` job per N: yields (N, every rank's result), with progress
    lines on stderr before and after each job."""
    cores = os.cpu_count() or 1
    for n in ranks:
        start = time.monotonic()
        print(f"[bench] {name}: N={n} on {cores} cores ...", file=sys.stderr, flush=True)
        yield n, spawn(f"bench.{name}:worker", n, args, config.timeout_s)
        print(f"[bench]   N={n} done in {time.monotonic() - start:.0f}s", file=sys.stderr)


def report_meta(config: BenchConfig, /, **extra: Any) -> dict[str, Any]:
    """The ``meta`` of a gloo benchmark's JSON: host, backend, quick, then `extra`."""
    return {**host_info(), "backend": "gloo", "quick": config.quick, **extra}


def n_label(r: _Row) -> str:
    """N, with ``*`` when the job had more workers than cores."""
    return f"{r.world_size}{'*' if r.oversubscribed else ''}"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` to two decimals; ``n/a`` when either is unknown or b is not positive."""
    return f"{a / b:.2f}" if a is not None and b is not None and b > 0 else "n/a"


def paired(a: Measurement, b: Measurement) -> list[float | None]:
    """`paired_ratio` of ``a / b`` as the JSON-friendly ``[median, low, high]``."""
    r = paired_ratio(a, b)
    return [r.median, r.low, r.high]


def oversubscribed_notes(rows: Iterable[_Row], cores: int, text: str = OVERSUBSCRIBED) -> list[str]:
    """`text` (formatted with `cores`) when some row had more workers than cores, else []."""
    return [text.format(cores=cores)] if any(r.oversubscribed for r in rows) else []


def calls_text(lines: Iterable[str]) -> str:
    """`CALLS_HEADER` and one indented line per entry."""
    return "\n".join([CALLS_HEADER, *(f"  {line}" for line in lines)])


# --------------------------------------------------------------------------- the workers


def chunk(step: Step, steps: int, threads: int | None = None) -> Callable[[], None]:
    """`steps` steps per call (compare's unit); with `threads`, that many torch threads."""
    import torch

    def call() -> None:
        saved = torch.get_num_threads()
        if threads is not None and threads != saved:
            torch.set_num_threads(threads)
        for _ in range(steps):
            step()
        if threads is not None and threads != saved:
            torch.set_num_threads(saved)

    return call


def fastest_threads(step: Step, rank: int, steps: int) -> int:
    """Rank 0: the faster of 1 thread and all cores for `steps` steps; 1 elsewhere."""
    import torch

    if rank != 0:
        return 1
    saved, best = torch.get_num_threads(), None
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        took = time.perf_counter() - start
        best = min(best or (took, threads), (took, threads))
    torch.set_num_threads(saved)
    assert best is not None
    return best[1]


def exit_quietly() -> None:
    """At exit, once the job has been left cleanly (``release()`` destroyed the process group,
    which `bench._worker` does only after writing this rank's result), skip the interpreter's
    finalization: after the DTensor runs on gloo it sometimes aborts there ("terminate called
    without an active exception", no Python frame; about 1 job in 10), which `spawn` would
    report as a failed job. A rank that failed never released, so its exit status is kept."""
    import torch.distributed as dist

    if not dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def sw_accounting(step: Step, steps: int) -> tuple[CommRecorder, str, float]:
    """Shardwise steps under `CommRecorder`: (the recorder of one step, its calls as
    ``kind(f|b|s)[elements]``, the collectives' seconds per step over `steps` more steps: each
    call's minimum over ranks (the last rank to arrive waits least: about the transfer alone,
    without waiting for slower ranks), summed)."""
    import torch
    import torch.distributed as dist

    from shardwise.communication import CommRecorder

    with CommRecorder() as rec:
        step()
    calls = " ".join(f"{r.kind}({r.phase[0]})[{r.numel}]" for r in rec.records)
    with CommRecorder() as timed:
        for _ in range(steps):
            step()
    seconds = torch.tensor([r.seconds for r in timed.records], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MIN)  # same calls in the same order everywhere
    return rec, calls, float(seconds.sum()) / steps


# c10d op (functional collectives and the in-place ProcessGroup ops) -> (kind, input index)
_KINDS = {
    "all_reduce": ("AllReduce", 0), "allreduce_": ("AllReduce", 0),
    "allreduce_coalesced_": ("AllReduce", 0),
    "all_gather_into_tensor": ("AllGather", 0), "_allgather_base_": ("AllGather", 1),
    "allgather_": ("AllGather", 1), "allgather_into_tensor_coalesced_": ("AllGather", 1),
    "reduce_scatter_tensor": ("ReduceScatter", 0), "_reduce_scatter_base_": ("ReduceScatter", 1),
    "reduce_scatter_": ("ReduceScatter", 1),
    "reduce_scatter_tensor_coalesced_": ("ReduceScatter", 1),
    "broadcast_": ("Broadcast", 0), "all_to_all_single": ("AlltoAll", 0),
    "alltoall_base_": ("AlltoAll", 1),
}  # fmt: skip


def _group_size(args: Any) -> int:
    """The size of the group a c10d op's `args` name: a boxed ProcessGroup (the in-place ops),
    else a group name (the functional collectives), else the world."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (  # type: ignore[attr-defined]
        _resolve_process_group as resolve,
    )

    named = [a for a in args if isinstance(a, str)]
    boxed = [a for a in args if isinstance(a, torch.ScriptObject)]
    unboxed = [dist.ProcessGroup.unbox(a) for a in boxed if "ProcessGroup" in str(a)]
    if unboxed:
        return int(unboxed[0].size())
    if named:
        return int(resolve(cast(Any, named[-1])).size())
    return dist.get_world_size()


def _priced(kind: str, index: int, args: Any) -> tuple[str, int, int]:
    """(kind, elements, bytes_bound) of one c10d call."""
    import torch

    from shardwise.communication import bytes_bound

    value = args[index]
    tensors = value if isinstance(value, list | tuple) else [value]
    if tensors and isinstance(tensors[0], list | tuple):  # allgather_: list of lists
        tensors = [t for inner in tensors for t in inner]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    numel = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return kind, numel, bytes_bound(kind, nbytes, _group_size(args))


def spy_mode() -> Any:
    """A `CollectiveSpy` (a ``TorchDispatchMode`` subclass, built lazily: torch is imported in
    the workers only): records every c10d collective dispatched inside as (kind, elements,
    bytes_bound), the in-place ProcessGroup ops DDP's reducer, FSDP2 and
    ZeroRedundancyOptimizer dispatch included. An op on DTensors is handed back
    (``NotImplemented``) so that DTensor's own dispatch runs with the mode still active: the
    collectives of its implicit redistributions are seen too."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveSpy(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int, int]] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            name = func.__name__.split(".")[0]
            if name in _KINDS and "c10d" in str(func):
                self.calls.append(_priced(*_KINDS[name], args))
            return func(*args, **(kwargs or {}))

    return CollectiveSpy()


def torch_accounting(step: Step) -> tuple[int, int, str]:
    """One PyTorch step under the spy: (collectives, bytes per rank, each call)."""
    spy = spy_mode()
    with spy:
        step()
    calls = " ".join(f"{k}[{numel}]" for k, numel, _ in spy.calls)
    return len(spy.calls), sum(b for _, _, b in spy.calls), calls


def tp_accounting(sw: Step, dt: Step, steps: int) -> dict[str, Any]:
    """The communication fields of a shardwise-vs-DTensor result: shardwise's collectives,
    forward / backward bytes per rank, calls and collective seconds per step
    (`sw_accounting`), and DTensor's collectives, bytes and calls (`torch_accounting`)."""
    rec, calls, seconds = sw_accounting(sw, steps)
    dt_count, dt_bytes, dt_calls = torch_accounting(dt)
    return {
        "sw_collectives": rec.count(),
        "sw_fwd_bytes": sum(r.bytes_sent for r in rec.select(phase="forward")),
        "sw_bwd_bytes": sum(r.bytes_sent for r in rec.select(phase="backward")),
        "sw_calls": calls,
        "sw_comm_s": seconds,
        "dt_collectives": dt_count,
        "dt_bytes": dt_bytes,
        "dt_calls": dt_calls,
    }


@dataclass(frozen=True, kw_only=True)
class TPResult:
    """What a shardwise-vs-DTensor benchmark records for one configuration (the benchmark's
    record adds its own fields: the mesh, the layout, a bound, ...)."""

    world_size: int
    shardwise_s: float  # per step, median of the repetitions, max over ranks
    dtensor_s: float
    single_s: float  # one process, `single_threads` threads
    single_threads: int
    sw_comm_s: float  # CommRecorder's collective wall time per step (each call's min over ranks)
    diff_dtensor: float  # max |loss shardwise - loss DTensor| over the check steps
    diff_single: float  # max |loss shardwise - loss one process|
    diff_dt_params: float  # max |DTensor parameter - one-process parameter| after the check
    sw_fwd_bytes: int  # CommRecorder per rank per step, forward (bytes_bound)
    sw_bwd_bytes: int
    sw_collectives: int
    sw_calls: str  # the step's collectives in order
    dt_bytes: int  # DTensor's collectives priced with bytes_bound
    dt_collectives: int
    dt_calls: str
    lo_shardwise_bytes: float | None  # measured loopback bytes per rank per step
    lo_dtensor_bytes: float | None
    steps_per_call: int
    reps: int
    oversubscribed: bool
    losses: list[float] = field(default_factory=list)
    sw_dt_ratio: list[float | None] = field(default_factory=list)  # `paired_ratio`: med, lo, hi

    @property
    def sw_dt(self) -> str:
        """shardwise / DTensor: the paired ratio with its 95 % interval (`harness.Ratio`)."""
        if not self.sw_dt_ratio:
            return ratio(self.shardwise_s, self.dtensor_s)
        median, low, high = self.sw_dt_ratio
        assert median is not None
        return str(Ratio(median, low, high))

    @property
    def worst_diff(self) -> float:
        """The largest of the three check differences."""
        return max(self.diff_dtensor, self.diff_single, self.diff_dt_params)


def check_three(
    sw: Step,
    dt: Step,
    single: Step,
    dt_full: Callable[[], list[torch.Tensor]],
    single_params: Iterable[torch.Tensor],
    rank: int,
    steps: int,
) -> tuple[float, float, float, list[float]]:
    """Train fresh shardwise / DTensor / one-process copies `steps` steps side by side (the one
    process on rank 0 only): (max |loss sw - loss DTensor|, max |loss sw - loss one process|,
    max |DTensor parameter - one-process parameter| after the steps, shardwise's losses).
    `dt_full` gives DTensor's parameters whole (a collective: every rank calls it). Ranks
    other than 0 get zeros and no losses."""
    import torch

    losses = torch.zeros(3, steps, dtype=torch.float64)
    for i in range(steps):
        losses[0, i], losses[1, i] = (
            float(cast(Any, sw()).detach()),
            float(cast(Any, dt()).detach()),
        )
        if rank == 0:
            losses[2, i] = float(cast(Any, single()).detach())
    full = dt_full()
    if rank != 0:
        return 0.0, 0.0, 0.0, []
    diff_params = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(full, single_params, strict=True)
    )
    diff_dt = float((losses[0] - losses[1]).abs().max())
    return diff_dt, float((losses[0] - losses[2]).abs().max()), diff_params, losses[0].tolist()
