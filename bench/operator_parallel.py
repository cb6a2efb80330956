"""Operator-level parallel (seed 003's network): shardwise AutoParallel vs DTensor vs one process.

For every N (default 2 and 4; 8 only when asked, oversubscribed on 2 cores) one gloo job runs
`worker`. Every rank trains seed 003's network (``examples/operator_parallel.py``: Flatten,
MatMul ((2, 4), (4, 1)), ReLU ((4, 1),), MatMul ((1, 8), (8, 1)), ReLU ((8, 1),), MatMul;
strategies scaled by the example's `strategies(N)`) on its rows of a global batch of 32
(synthetic MNIST-shaped inputs, the same on every rank), SGD lr 1e-2, four ways:

- ``shardwise``: the example's step: ``sw.AutoParallel(net)``, ``loss =
  sw.ops.AllReduce()(cross_entropy(logits, rows_labels)) / N``, backward, SGD;
- ``DTensor``: the same layouts written by hand with ``torch.distributed.tensor`` on an
  ``init_device_mesh("cpu", ...)`` mesh of shardwise's device matrix (`DTENSOR_PLANS`): weights
  from ``distribute_tensor``, the input rows ``DTensor.from_local`` with ``Shard(0)``, a
  ``redistribute`` wherever the strategy changes, matmuls / relu as DTensor ops, local cross
  entropy / N, and the loss value all-reduced once (shardwise's step returns it on every rank);
- ``one process``: rank 0 alone on all 32 rows (the others wait in the closing barrier);
- ``local compute``: each rank runs only the local blocks of the shardwise plan (same local
  shapes, forward + backward + SGD, no communication): the compute part of a parallel step.

`_check` trains fresh copies 3 steps and compares losses (and the DTensor parameters with the
one-process ones); `bench._common.tp_accounting` records shardwise's collectives with
`CommRecorder` and DTensor's functional collectives with a dispatch mode (`CollectiveSpy`)
and prices them with the same `bytes_bound`; `harness.compare` times the four candidates.
`run` prints three tables (step time; communication; shardwise's overhead) and saves
``operator_parallel.json`` / ``operator_parallel.txt``.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from bench import harness
from bench._common import (
    TPResult,
    calls_text,
    check_three,
    chunk,
    exit_quietly,
    fastest_threads,
    jobs,
    n_label,
    oversubscribed_notes,
    paired,
    ranks_for,
    ratio,
    report_meta,
    tp_accounting,
)
from bench.harness import REPO_ROOT, BenchConfig, Table, compare, fmt_bytes, fmt_ms

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

GLOBAL_BATCH = 32
LR = 1e-2
POOL = 4  # distinct global batches, cycled through
CHECK_STEPS = 3
CHECK_ATOL = 1e-5
ALLOWED_RANKS = (2, 4, 8)  # the example's `strategies` knows these
EXAMPLE = REPO_ROOT / "examples" / "operator_parallel.py"
Step = Callable[[], "torch.Tensor"]  # one training step; returns the global mean loss

# The hand-written DTensor plan: mesh shape and placements ("S<d>" = Shard(d), "R" =
# Replicate()) per mesh dim, read off shardwise's plan (`NetworkPlan` on the common device
# matrix; mesh dim i = matrix axis g<i>). inp: the rows each rank is given; x1 / w1: matmul1's
# operands (its output is Partial over the contracted dims); r1: relu1; x2 / w2: matmul2;
# r2: relu2 (= matmul3's input); w3: matmul3's weight (data parallel).
DTENSOR_PLANS: dict[int, dict[str, str]] = {
    2: {"mesh": "2", "inp": "S0", "x1": "S0", "w1": "R", "r1": "R", "x2": "S1", "w2": "S0",
        "r2": "S0", "w3": "R"},
    4: {"mesh": "2 2", "inp": "S0 S0", "x1": "S0 S1", "w1": "R S0", "r1": "S0 R",
        "x2": "S1 S1", "w2": "S0 S0", "r2": "S0 S0", "w3": "R R"},
    8: {"mesh": "2 2 2", "inp": "S0 S0 S0", "x1": "S0 S1 S1", "w1": "R S0 S0",
        "r1": "S0 S0 R", "x2": "S1 S1 S1", "w2": "S0 S0 S0", "r2": "S0 S0 S0", "w3": "R R R"},
}  # fmt: skip
IN_FEATURES, HIDDEN, CLASSES = 28 * 28, 512, 10


@dataclass(frozen=True, kw_only=True)
class OpResult(TPResult):
    """One N: step times, the correctness check, communication and overhead of one step (the
    shared fields: `bench._common.TPResult`)."""

    mesh: str
    local_s: float  # local blocks only, no communication (max over ranks)

    @property
    def equal(self) -> bool:
        """Whether the three losses (and DTensor's parameters) matched during the check."""
        return self.worst_diff <= CHECK_ATOL

    @property
    def overhead_s(self) -> float:
        """Shardwise's step time beyond communication and local compute (approximate)."""
        return self.shardwise_s - self.sw_comm_s - self.local_s


# --------------------------------------------------------------------------- the network


@functools.cache
def example() -> ModuleType:
    """``examples/operator_parallel.py`` (not a package: loaded from its path)."""
    spec = importlib.util.spec_from_file_location("_sw_example_operator_parallel", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_net(n: int) -> torch.nn.Module:
    """The example's network with its strategies for `n` devices, weights seeded (seed 1)."""
    import shardwise as sw

    sw.set_seed(1)
    net: torch.nn.Module = example().Network(example().strategies(n))
    return net


def full_weights(n: int) -> list[torch.Tensor]:
    """Copies of the global weights fc1, fc2, fc3 (the same values `make_net` starts from)."""
    net = make_net(n)
    return [getattr(net, f"fc{i}_weight").detach().clone() for i in (1, 2, 3)]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """`POOL` synthetic global batches (images ~ N(0, 1), labels 0..9), equal on every rank."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(POOL, GLOBAL_BATCH, 1, 28, 28, generator=g)
    return x, torch.randint(0, CLASSES, (POOL, GLOBAL_BATCH), generator=g)


def _rows(n: int, rank: int) -> slice:
    return slice(rank * GLOBAL_BATCH // n, (rank + 1) * GLOBAL_BATCH // n)


def _batches(rows: slice) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Each call: the next global batch's rows `rows` (images, labels)."""
    x, y = _data()
    counter = itertools.count()

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        i = next(counter) % POOL
        return x[i, rows], y[i, rows]

    return next_batch


# --------------------------------------------------------------------------- the candidates


def shardwise_step(n: int, rank: int) -> tuple[torch.nn.Module, Step]:
    """The example's training step under ``sw.AutoParallel`` on this rank's rows."""
    import torch
    import torch.nn.functional as F

    import shardwise as sw

    net = make_net(n)
    parallel_net = sw.AutoParallel(net, parallel_mode="semi_auto")
    opt = torch.optim.SGD(net.parameters(), LR)
    all_reduce, batch = sw.ops.AllReduce(), _batches(_rows(n, rank))

    def step() -> torch.Tensor:
        x, y = batch()
        loss: torch.Tensor = all_reduce(F.cross_entropy(parallel_net(x), y)) / n
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return net, step


def placements(text: str) -> list[Placement]:
    """``"S0 R"`` -> ``[Shard(0), Replicate()]``."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in text.split()]


def dtensor_step(n: int, rank: int) -> tuple[list[DTensor], Step]:
    """The same layouts as a PyTorch user writes them with DTensor (`DTENSOR_PLANS`)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    plan = {k: placements(v) for k, v in DTENSOR_PLANS[n].items() if k != "mesh"}
    mesh = init_device_mesh("cpu", tuple(int(s) for s in DTENSOR_PLANS[n]["mesh"].split()))
    w1, w2, w3 = (
        cast(DTensor, torch.nn.Parameter(distribute_tensor(t, mesh, plan[f"w{i}"])))
        for i, t in enumerate(full_weights(n), start=1)
    )
    opt = torch.optim.SGD([w1, w2, w3], LR)
    batch = _batches(_rows(n, rank))

    def to(t: torch.Tensor, key: str) -> DTensor:
        return cast(DTensor, t).redistribute(mesh, plan[key])

    def step() -> torch.Tensor:
        x, y = batch()
        h: torch.Tensor = to(DTensor.from_local(x.flatten(1), mesh, plan["inp"]), "x1")
        h = to(h @ w1, "r1").relu()
        h = to(to(h, "x2") @ w2, "r2").relu()
        logits = cast(DTensor, h @ w3).to_local()
        loss = F.cross_entropy(logits, y) / n
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        return value

    return [w1, w2, w3], step


def single_step(n: int) -> tuple[list[torch.Tensor], Step]:
    """One process, plain torch, all 32 rows, the same initial weights."""
    import torch
    import torch.nn.functional as F

    weights = [w.requires_grad_() for w in full_weights(n)]
    opt = torch.optim.SGD(weights, LR)
    batch = _batches(slice(None))

    def step() -> torch.Tensor:
        x, y = batch()
        h = (x.flatten(1) @ weights[0]).relu()
        h = (h @ weights[1]).relu()
        loss = F.cross_entropy(h @ weights[2], y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return weights, step


def local_shape(shape: Sequence[int], plan: str, mesh: str) -> tuple[int, ...]:
    """The block of a global `shape` one rank holds under placements `plan` on `mesh`."""
    out = list(shape)
    for size, p in zip(mesh.split(), plan.split(), strict=True):
        if p != "R":
            out[int(p[1:])] //= int(size)
    return tuple(out)


def local_step(n: int, rank: int) -> Step:
    """Only the local blocks of the plan (shapes from `DTENSOR_PLANS`), no communication:
    matmul1, relu1, matmul2, relu2, matmul3 + cross entropy forward; backward through each
    block with upstream gradients of ones (`autograd.backward` with given grads); SGD."""
    import torch
    import torch.nn.functional as F

    p = DTENSOR_PLANS[n]

    def block(shape: tuple[int, int], key: str, grad: bool = True) -> torch.Tensor:
        return torch.randn(local_shape(shape, p[key], p["mesh"])).requires_grad_(grad)

    act = (GLOBAL_BATCH, HIDDEN)
    a1, a2, a3 = block((GLOBAL_BATCH, IN_FEATURES), "x1", False), block(act, "x2"), block(act, "r2")
    h1, h2 = block(act, "r1"), block(act, "r2")
    ws = [block((IN_FEATURES, HIDDEN), "w1"), block((HIDDEN, HIDDEN), "w2")]
    ws.append(block((HIDDEN, CLASSES), "w3"))
    opt, y = torch.optim.SGD(ws, LR), torch.randint(0, CLASSES, (a3.shape[0],))

    def step() -> torch.Tensor:
        outs = [a1 @ ws[0], h1.relu(), a2 @ ws[1], h2.relu()]
        loss = F.cross_entropy(a3 @ ws[2], y) / n
        torch.autograd.backward([loss, *outs], [None, *(torch.ones_like(o) for o in outs)])
        opt.step()
        opt.zero_grad()
        for t in (a2, a3, h1, h2):  # the real step's activations keep no gradient either
            t.grad = None
        return loss.detach()

    return step


# --------------------------------------------------------------------------- the worker


def _check(n: int, rank: int) -> tuple[float, float, float, list[float]]:
    """`check_three` on fresh shardwise / DTensor / one-process copies, `CHECK_STEPS` steps
    each (the losses are the same on every rank: rank 0's are returned)."""
    (_, sw), (dt_params, dt) = shardwise_step(n, rank), dtensor_step(n, rank)
    single_params, single = single_step(n)

    def dt_full() -> list[torch.Tensor]:
        return [p.full_tensor() for p in dt_params]  # collective: every rank

    return check_three(sw, dt, single, dt_full, single_params, rank, CHECK_STEPS)


def _time(n: int, rank: int, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Account, then time the four candidates side by side: (measurements, accounting)."""
    (_, sw), (_, dt) = shardwise_step(n, rank), dtensor_step(n, rank)
    _, single = single_step(n)
    local = local_step(n, rank)
    steps, reps = (2, 2) if quick else (10, 21)
    for _ in range(2):
        sw(), dt(), local()
    acc = tp_accounting(sw, dt, steps)
    acc["single_threads"] = threads = fastest_threads(chunk(single, 1), rank, 3 if quick else 10)
    candidates = {
        "shardwise": chunk(sw, steps),
        "DTensor": chunk(dt, steps),
        "one process": chunk(single, steps, threads) if rank == 0 else lambda: None,
        "local compute": chunk(local, steps),
    }
    m = compare(candidates, iters=1, reps=reps, warmup=1, barrier=harness.barrier_bytes())
    lo = {k: v.median_lo_bytes for k, v in m.items()}
    return {
        "shardwise_s": m["shardwise"].median_s / steps,
        "dtensor_s": m["DTensor"].median_s / steps,
        "single_s": m["one process"].median_s / steps,
        "local_s": m["local compute"].median_s / steps,
        "lo_shardwise_bytes": None if lo["shardwise"] is None else lo["shardwise"] / steps,
        "lo_dtensor_bytes": None if lo["DTensor"] is None else lo["DTensor"] / steps,
        "steps_per_call": steps,
        "reps": reps,
        "sw_dt_ratio": paired(m["shardwise"], m["DTensor"]),
    }, acc


def worker(args: dict[str, Any]) -> dict[str, Any] | None:
    """Check, account, time on this job's N ranks; rank 0 returns an `OpResult` as a dict."""
    import torch.distributed as dist

    atexit.register(exit_quietly)
    n, rank = dist.get_world_size(), dist.get_rank()
    diff_dt, diff_single, diff_params, losses = _check(n, rank)
    timed, acc = _time(n, rank, bool(args["quick"]))
    if rank != 0:
        return None
    result = OpResult(
        world_size=n, mesh=DTENSOR_PLANS[n]["mesh"].replace(" ", "x"), diff_dtensor=diff_dt,
        diff_single=diff_single, diff_dt_params=diff_params, losses=losses,
        oversubscribed=n > (os.cpu_count() or 1), **timed, **acc,
    )  # fmt: skip
    return asdict(result)


# --------------------------------------------------------------------------- the parent


def time_table(rows: list[OpResult]) -> Table:
    """Step times and ratios, one line per N."""
    t = Table(
        f"Operator-level parallel, seed 003 network, global batch {GLOBAL_BATCH}: time per "
        "training step",
        ["N", "mesh", "rows/rank", "shardwise ms", "DTensor ms", "one process ms", "sw/DT",
         "sw/one", "DT/one", "losses sw = DT = one (max |diff|)"],
    )  # fmt: skip
    for r in rows:
        worst = r.worst_diff
        t.rows.append(
            [n_label(r), r.mesh, str(GLOBAL_BATCH // r.world_size), fmt_ms(r.shardwise_s),
             fmt_ms(r.dtensor_s), f"{fmt_ms(r.single_s)} ({r.single_threads}t)",
             r.sw_dt, ratio(r.shardwise_s, r.single_s),
             ratio(r.dtensor_s, r.single_s), f"{'yes' if r.equal else 'NO'} ({worst:.1e})"]
        )  # fmt: skip
    return t


def comm_table(rows: list[OpResult]) -> Table:
    """Bytes and collectives per step per rank, one line per N."""
    t = Table(
        "Operator-level parallel: communication per step per rank",
        ["N", "sw fwd", "sw bwd", "sw total", "DT bound", "sw/DT", "lo sw", "lo DT",
         "colls sw", "colls DT"],
    )  # fmt: skip
    for r in rows:
        total = r.sw_fwd_bytes + r.sw_bwd_bytes
        t.rows.append(
            [n_label(r), fmt_bytes(r.sw_fwd_bytes), fmt_bytes(r.sw_bwd_bytes), fmt_bytes(total),
             fmt_bytes(r.dt_bytes), ratio(total, r.dt_bytes), fmt_bytes(r.lo_shardwise_bytes),
             fmt_bytes(r.lo_dtensor_bytes), str(r.sw_collectives), str(r.dt_collectives)]
        )  # fmt: skip
    return t


def overhead_table(rows: list[OpResult]) -> Table:
    """Shardwise's step split into communication, local compute and the rest."""
    t = Table(
        "Operator-level parallel: shardwise step = communication + local compute + overhead",
        ["N", "shardwise ms", "collectives ms", "local compute ms", "overhead ms", "overhead %",
         "DTensor - local ms"],
    )  # fmt: skip
    for r in rows:
        t.rows.append(
            [n_label(r), fmt_ms(r.shardwise_s), fmt_ms(r.sw_comm_s), fmt_ms(r.local_s),
             fmt_ms(r.overhead_s), f"{100 * r.overhead_s / r.shardwise_s:.0f}%",
             fmt_ms(r.dtensor_s - r.local_s)]
        )  # fmt: skip
    return t


def _notes(rows: list[OpResult], cores: int) -> list[str]:
    r0 = rows[0]
    notes = [
        f"ms: per step (forward + backward + SGD step), median of {r0.reps} repetitions of "
        f"{r0.steps_per_call} steps, max over ranks; the candidates alternate within one job. "
        "sw/DT > 1: shardwise slower; sw/DT is the median of the repetitions' paired ratios "
        "(95 % interval in brackets: one holding 1.00 cannot tell the two apart here). "
        "one process: rank 0 alone on all 32 rows, (kt) = the faster of 1 thread and all "
        "cores; each parallel rank runs cores/N torch threads",
        f"losses: fresh copies trained {CHECK_STEPS} steps on the same batches; yes = every loss "
        f"(and every DTensor parameter vs one process) within {CHECK_ATOL:g}",
        "sw fwd / bwd: CommRecorder's bytes per rank (each collective's ring/pairwise "
        "bytes_bound), by phase; DT bound: DTensor's functional collectives (seen by a dispatch "
        "mode) plus its one loss all-reduce, priced with the same bytes_bound; lo: measured "
        "loopback bytes per rank per step (TCP/IP headers, gloo control messages included, the "
        "framing barriers subtracted)",
        "collectives ms: CommRecorder's wall time of shardwise's collectives per step, each "
        "call's minimum over ranks (the last rank to arrive waits least), summed; local "
        "compute: each rank runs only its local blocks of the plan (same local shapes, forward "
        "+ backward + SGD, no communication, max over ranks); overhead = shardwise ms - "
        "collectives ms - local compute ms: hooks, layout tracking, redistribution "
        "slicing/concatenation, autograd bookkeeping (approximate: the local run does not "
        "reproduce the real step's cache behaviour or rank skew)",
    ]
    return notes + oversubscribed_notes(rows, cores)


def _calls(rows: list[OpResult]) -> str:
    """Each N's collectives in order: shardwise's kind(f|b)[elements], then DTensor's."""
    return calls_text(
        line
        for r in rows
        for line in (
            f"N={n_label(r)} shardwise: {r.sw_calls}",
            f"N={n_label(r)} DTensor:   {r.dt_calls}",
        )
    )


def _ranks(config: BenchConfig) -> tuple[int, ...]:
    """N = 2, 4 for the default ``--ranks``; otherwise ``--ranks`` (each of 2, 4, 8)."""
    why = "operator_parallel: --ranks {bad}: the example has strategies for 2, 4, 8"
    return ranks_for(config, lambda n: n not in ALLOWED_RANKS, why)


def run(config: BenchConfig) -> str:
    """Spawn one job per N, print and save the tables; return the printed text."""
    args = {"quick": config.quick}
    rows = [
        OpResult(**got[0]) for _, got in jobs("operator_parallel", config, _ranks(config), args)
    ]
    over = overhead_table(rows)
    over.notes = _notes(rows, os.cpu_count() or 1)
    text = f"{time_table(rows)}\n\n{comm_table(rows)}\n\n{over}\n\n{_calls(rows)}"
    data = {
        "meta": report_meta(config, lr=LR, global_batch=GLOBAL_BATCH, dtensor_plans=DTENSOR_PLANS),
        "rows": [{**asdict(r), "equal": r.equal, "overhead_s": r.overhead_s,
                  "sw_over_dtensor": r.shardwise_s / r.dtensor_s,
                  "sw_over_single": r.shardwise_s / r.single_s} for r in rows],
    }  # fmt: skip
    harness.save_report(config.out_dir, "operator_parallel", data, text)
    return text
