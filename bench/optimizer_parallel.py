"""Optimizer parallel (ZeRO-style sharding): shardwise hsdp levels 1-3 vs DDP / ZeRO / FSDP2.

For every N (default 2 and 4; 4 on 2 cores is oversubscribed) one gloo job runs `worker`, which
for each of two networks in turn trains eight copies of it (AdamW, so the optimizer state
matters) side by side on the same global batches:

- ``mlp``: seed 000's MNIST MLP (Flatten, Linear 784-512, ReLU, Linear 512-512, ReLU,
  Linear 512-10) on a global batch of 32 synthetic MNIST-shaped images;
- ``wide``: two blocks Linear(1024, 4096), GELU, Linear(4096, 1024), GELU, then a head
  Linear(1024, 10), on a global batch of 64 random 1024-vectors (``--quick``: d 128, f 512).

Candidates (a training step is forward + backward + ``AdamW.step()`` + ``zero_grad()``):

- ``sw dp``: ``sw.AutoParallel(train_step, parallel_mode="semi_auto")`` without hsdp (plain data
  parallel: the gradient AllReduces in 25 MB buckets, DDP's default; the layers' fusion ids
  are not used without a ``comm_fusion`` call);
- ``sw level1`` / ``level2`` / ``level3``: the same with
  ``.hsdp(threshold=0, optimizer_level=L)``. Every rank passes the GLOBAL batch to the wrapped
  train step (``loss = loss_fn(net(x), y); loss.backward(); opt.step(); opt.zero_grad(); return
  loss``), which cuts its rows; the optimizer is built on ``net.parameters()`` before the first
  call (the engine cuts those same Parameter objects to their shards);
- ``DDP``: ``DistributedDataParallel(net)`` with ``torch.optim.AdamW``;
- ``DDP+ZeRO-1``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``;
- ``FSDP2 zero2`` / ``zero3``: ``fully_shard`` on every ``nn.Linear`` and then the root, on an
  ``init_device_mesh("cpu", (N,))`` mesh, ``reshard_after_forward=False`` / ``True``.

The PyTorch candidates get this rank's rows and all-reduce the loss value once (so every
candidate returns the global mean loss). `_check_losses` compares the first `CHECK_STEPS`
losses of every candidate with DDP's (max relative difference). Communication per step:
shardwise's `CommRecorder`; the PyTorch candidates' c10d collectives seen by a
``TorchDispatchMode`` (``bench._common.spy_mode``, shared with ``bench.operator_parallel``:
a ``CollectiveSpy`` extended to the in-place ProcessGroup ops DDP's reducer, FSDP2 and
ZeroRedundancyOptimizer dispatch: ``allreduce_``, ``_allgather_base_``,
``_reduce_scatter_base_``, ``broadcast_``, ...), all priced with ``bytes_bound``; the loopback
counter measures what really crossed. `bound_bytes` is the textbook minimum, `state_bytes` the
textbook model-state size. Peak RSS is measured by `mem_worker` in a fresh job per
configuration of the wide network (``ru_maxrss``; the growth over the RSS right before the
network is built; ``--quick``: ``sw level3`` only).
`run` prints three tables and saves ``optimizer_parallel.json`` / ``optimizer_parallel.txt``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import resource
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from bench import _common as common
from bench import harness
from bench._common import n_label, ratio
from bench.harness import BenchConfig, Table, compare, fmt_bytes, fmt_ms, spawn

if TYPE_CHECKING:
    import torch

LR = 1e-3
POOL = 4  # distinct global batches, cycled through
CHECK_STEPS = 3
CHECK_RTOL = 1e-4  # max relative loss difference counted as "equal" to DDP
MEM_STEPS = 3
CLASSES = 10
MODELS = ("mlp", "wide")
# model -> (global batch, input features, hidden d, ffn f, blocks); mlp: seed 000's MNIST MLP
SHAPES = {"mlp": (32, 28 * 28, 512, 512, 0), "wide": (64, 1024, 1024, 4096, 2)}
QUICK_SHAPES = {"mlp": (32, 28 * 28, 512, 512, 0), "wide": (16, 128, 128, 512, 2)}
SW = ("sw dp", "sw level1", "sw level2", "sw level3")
BASELINES = ("DDP", "DDP+ZeRO-1", "FSDP2 zero2", "FSDP2 zero3")
CANDIDATES = SW + BASELINES
MEM_MODEL = "wide"  # fresh-process RSS: the mlp's 2.6 MiB of parameters drown in RSS noise
QUICK_MEM = ("sw level3",)  # --quick: fresh-process RSS for this one only
LEVEL = {"sw dp": None, "sw level1": "level1", "sw level2": "level2", "sw level3": "level3"}
Step = Callable[[], "torch.Tensor"]  # one training step; returns the global mean loss

STATE_FORMULA = (
    "model state per rank (params + grads + AdamW exp_avg/exp_avg_sq), P = parameter bytes: "
    "sw dp, DDP: 4P (ZeRO-0); DDP+ZeRO-1, sw level1: 2P + 2P/N (state sharded); sw level2, "
    "FSDP2 zero2: P + 3P/N (grads and state sharded, whole weights kept from forward to "
    "backward); sw level3, FSDP2 zero3: 4P/N (everything sharded)"
)
BOUND_FORMULA = (
    "bound per rank per step (bytes_bound of the ideal collectives, AR = 2(N-1)/N, AG/RS/Bcast "
    "= (N-1)/N of P): sw dp, DDP: AR(P); sw level1/2, FSDP2 zero2: AG + RS = 2(N-1)/N P; "
    "DDP+ZeRO-1: AR(P) + Bcast(P) = 3(N-1)/N P; sw level3, FSDP2 zero3: 2 AG + RS = 3(N-1)/N P; "
    "plus one AllReduce of the 4-byte loss"
)


def shapes(quick: bool) -> dict[str, tuple[int, int, int, int, int]]:
    return QUICK_SHAPES if quick else SHAPES


def param_count(model: str, quick: bool) -> int:
    """Parameters of `model` (weights and biases)."""
    _, d_in, d, f, blocks = shapes(quick)[model]
    if model == "mlp":
        return d_in * d + d + d * f + f + f * CLASSES + CLASSES
    return blocks * (d * f + f + f * d + d) + d * CLASSES + CLASSES


def state_bytes(name: str, p: int, n: int) -> int:
    """`STATE_FORMULA`: textbook model-state bytes per rank for candidate `name`, P = `p`."""
    if name in ("sw dp", "DDP"):
        return 4 * p
    if name in ("DDP+ZeRO-1", "sw level1"):
        return 2 * p + 2 * p // n
    if name in ("sw level2", "FSDP2 zero2"):
        return p + 3 * p // n
    return 4 * p // n  # sw level3, FSDP2 zero3


def bound_bytes(name: str, p: int, n: int) -> int:
    """`BOUND_FORMULA`: the ideal bytes per rank per step for candidate `name`, P = `p`."""
    from shardwise.communication import bytes_bound

    loss = bytes_bound("AllReduce", 4, n)
    if name in ("sw dp", "DDP"):
        return bytes_bound("AllReduce", p, n) + loss
    if name == "DDP+ZeRO-1":
        return bytes_bound("AllReduce", p, n) + bytes_bound("Broadcast", p, n) + loss
    gather = bytes_bound("AllGather", p // n, n)
    scatter = bytes_bound("ReduceScatter", p, n)
    if name in ("sw level3", "FSDP2 zero3"):
        return 2 * gather + scatter + loss
    return gather + scatter + loss


# --------------------------------------------------------------------------- the networks


def make_net(model: str, quick: bool) -> torch.nn.Module:
    """`model`'s network with seed-0 weights (the same on every rank and every candidate)."""
    import torch
    from torch import nn

    _, d_in, d, f, blocks = shapes(quick)[model]
    torch.manual_seed(0)
    if model == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(d_in, d), nn.ReLU(), nn.Linear(d, f), nn.ReLU(),
            nn.Linear(f, CLASSES),
        )  # fmt: skip
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(d, f), nn.GELU(), nn.Linear(f, d), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(d, CLASSES))


def _data(model: str, quick: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`POOL` global batches (inputs ~ N(0, 1), labels 0..9), equal on every rank."""
    import torch

    batch, d_in, *_ = shapes(quick)[model]
    g = torch.Generator().manual_seed(0)
    x_shape = (POOL, batch, 1, 28, 28) if model == "mlp" else (POOL, batch, d_in)
    x = torch.randn(x_shape, generator=g)
    return x, torch.randint(0, CLASSES, (POOL, batch), generator=g)


def _batches(model: str, quick: bool, rows: slice) -> Callable[[], tuple[Any, Any]]:
    """Each call: the next global batch's rows `rows` (inputs, labels)."""
    x, y = _data(model, quick)
    counter = itertools.count()

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        i = next(counter) % POOL
        return x[i, rows], y[i, rows]

    return next_batch


# --------------------------------------------------------------------------- the candidates


def shardwise_step(
    model: str, quick: bool, level: str | None, n: int, rank: int
) -> tuple[Any, Step]:
    """``AutoParallel(train_step)`` (+ ``.hsdp(threshold=0, optimizer_level=level)``), each
    ``nn.Linear`` with its own ``comm_fusion`` id (one bucket per layer, like FSDP2's units, so
    the buckets' collectives can overlap compute); every rank passes its rows of the global
    batch (``dataset_strategy("data_parallel")``). Returns (the wrapper, the step)."""
    import torch

    import shardwise as sw

    net = make_net(model, quick)
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    for i, layer in enumerate(linears):  # one bucket per Linear (as FSDP2's units; seed 000)
        sw.set_comm_fusion(layer, i + 1)
    opt = torch.optim.AdamW(net.parameters(), LR)  # before the first call: same Parameters
    loss_fn = torch.nn.CrossEntropyLoss()

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    parallel = sw.AutoParallel(train_step, parallel_mode="semi_auto")
    if level is not None:
        parallel = parallel.hsdp(threshold=0, optimizer_level=level)
    size = _data(model, quick)[0].shape[1]
    batch = _batches(model, quick, slice(rank * size // n, (rank + 1) * size // n))

    def step() -> torch.Tensor:
        loss: torch.Tensor = parallel(*batch())
        return loss.detach()

    return parallel, step


def torch_step(name: str, model: str, quick: bool, n: int, rank: int) -> Step:
    """A PyTorch baseline (`BASELINES`) on this rank's rows; the loss value all-reduced once."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    net = make_net(model, quick)
    if name in ("DDP", "DDP+ZeRO-1"):
        net = DistributedDataParallel(net)
    if name == "DDP+ZeRO-1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
        )
    else:
        if name.startswith("FSDP2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (n,))
            reshard = name.endswith("zero3")
            for m in net.modules():
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(net, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(net.parameters(), LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    batch_size = shapes(quick)[model][0]
    batch = _batches(model, quick, slice(rank * batch_size // n, (rank + 1) * batch_size // n))

    def step() -> torch.Tensor:
        x, y = batch()
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        return value / n

    return step


def make_step(name: str, model: str, quick: bool, n: int, rank: int) -> tuple[Any, Step]:
    """Candidate `name`: (shardwise's wrapper or None, its step)."""
    if name in SW:
        return shardwise_step(model, quick, LEVEL[name], n, rank)
    return None, torch_step(name, model, quick, n, rank)


# --------------------------------------------------------------------------- accounting


def sw_accounting(step: Step, steps: int) -> tuple[int, int, str, float]:
    """Shardwise steps under `CommRecorder` (`common.sw_accounting`): (collectives, bytes per
    rank, the calls of one step, the collectives' seconds per step)."""
    rec, calls, seconds = common.sw_accounting(step, steps)
    return rec.count(), sum(r.bytes_sent for r in rec.records), calls, seconds


# --------------------------------------------------------------------------- the workers


@dataclass(frozen=True)
class OptResult:
    """One model, one N, one candidate: time, communication, memory, loss parity."""

    model: str
    world_size: int
    name: str
    step_s: float  # per step, median of the repetitions, max over ranks
    cpu_s: float  # process CPU per step (all threads), median of the repetitions, max over ranks
    bytes_sent: int  # per rank per step: CommRecorder (shardwise) / the spy (PyTorch)
    bound: int  # `bound_bytes`
    collectives: int
    calls: str
    comm_s: float | None  # shardwise only: CommRecorder's collective seconds per step
    lo_bytes: float | None  # measured loopback bytes per rank per step
    loss_rel_diff: float  # max |loss - DDP loss| / |DDP loss| over the check steps
    param_bytes: int
    state_theory: int  # `state_bytes`
    steps_per_call: int
    reps: int
    oversubscribed: bool
    rss_peak: int | None = None  # bytes, max over ranks, fresh process (`mem_worker`)
    rss_growth: int | None = None  # peak minus the RSS before the network was built
    losses: list[float] = field(default_factory=list)


def _check_losses(steps: dict[str, Step]) -> dict[str, list[float]]:
    """`CHECK_STEPS` steps of every candidate (fresh copies): each one's losses."""
    return {name: [float(step()) for _ in range(CHECK_STEPS)] for name, step in steps.items()}


def _model_rows(model: str, quick: bool, n: int, rank: int) -> list[dict[str, Any]]:
    """Check, account and time the eight candidates on `model`; rank 0 gets `OptResult`s."""
    # mlp: 15 x 10 steps, enough to resolve ~1 ms of a ~15 ms step on this noisy host
    steps, reps = (1, 2) if quick else ((10, 15) if model == "mlp" else (1, 5))
    built = {name: make_step(name, model, quick, n, rank) for name in CANDIDATES}
    fns = {name: s for name, (_, s) in built.items()}
    losses = _check_losses(fns)
    acc: dict[str, tuple[int, int, str, float | None]] = {}
    for name, fn in fns.items():
        acc[name] = sw_accounting(fn, steps) if name in SW else (*common.torch_accounting(fn), None)
    if rank == 0:
        print(f"[{model} N={n}] {built['sw level1'][0].optimizer_plan}", flush=True)
    candidates = {name: common.chunk(fn, steps) for name, fn in fns.items()}
    m = compare(candidates, iters=1, reps=reps, warmup=1, barrier=harness.barrier_bytes())
    p = param_count(model, quick) * 4
    ref = losses["DDP"]
    out = []
    for name in CANDIDATES:
        count, sent, calls, comm_s = acc[name]
        lo = m[name].median_lo_bytes
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses[name], ref, strict=True))
        result = OptResult(
            model=model, world_size=n, name=name, step_s=m[name].median_s / steps,
            cpu_s=m[name].median_cpu_s / steps,
            bytes_sent=sent, bound=bound_bytes(name, p, n), collectives=count, calls=calls,
            comm_s=comm_s, lo_bytes=None if lo is None else lo / steps, loss_rel_diff=diff,
            param_bytes=p, state_theory=state_bytes(name, p, n), steps_per_call=steps,
            reps=reps, oversubscribed=n > (os.cpu_count() or 1), losses=losses[name],
        )  # fmt: skip
        out.append(asdict(result))
    return out


def worker(args: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every model of `MODELS`, one after the other (each model's copies freed before the
    next); rank 0 returns the `OptResult`s as dicts."""
    import torch.distributed as dist

    atexit.register(common.exit_quietly)
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = [r for model in MODELS for r in _model_rows(model, bool(args["quick"]), n, rank)]
    return rows if rank == 0 else None


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def mem_worker(args: dict[str, Any]) -> dict[str, int]:
    """One candidate alone in a fresh job: (peak RSS, peak minus the RSS before building)."""
    import torch.distributed as dist

    atexit.register(common.exit_quietly)
    n, rank = dist.get_world_size(), dist.get_rank()
    before = _maxrss_bytes()
    _, step = make_step(str(args["name"]), str(args["model"]), bool(args["quick"]), n, rank)
    for _ in range(MEM_STEPS):
        step()
    peak = _maxrss_bytes()
    return {"rss_peak": peak, "rss_growth": peak - before}


# --------------------------------------------------------------------------- the parent


def _describe(model: str, quick: bool) -> str:
    batch, d_in, d, f, blocks = shapes(quick)[model]
    if model == "mlp":
        net = f"MNIST MLP {d_in}-{d}-{f}-{CLASSES}"
    else:
        net = f"{blocks} x (Linear {d}-{f}, GELU, Linear {f}-{d}, GELU), head {d}-{CLASSES}"
    return f"{net}, {param_count(model, quick):,} params, global batch {batch}"


def time_table(rows: list[OptResult], model: str, quick: bool) -> Table:
    """Step times and bytes per (N, candidate) of one model."""
    t = Table(
        f"Optimizer parallel, {model} ({_describe(model, quick)}), AdamW: per training step",
        ["N", "candidate", "ms", "/best base", "/DDP", "cpu ms", "coll ms", "sent/rank", "bound",
         "sent/bound", "lo/rank", "colls", "loss rel diff vs DDP"],
    )  # fmt: skip
    for n in sorted({r.world_size for r in rows}):
        group = [r for r in rows if r.world_size == n]
        best = min(r.step_s for r in group if r.name in BASELINES)
        ddp = next(r.step_s for r in group if r.name == "DDP")
        for r in group:
            t.rows.append(
                [n_label(r), r.name, fmt_ms(r.step_s), ratio(r.step_s, best), ratio(r.step_s, ddp),
                 fmt_ms(r.cpu_s), "-" if r.comm_s is None else fmt_ms(r.comm_s),
                 fmt_bytes(r.bytes_sent), fmt_bytes(r.bound), ratio(r.bytes_sent, r.bound),
                 fmt_bytes(r.lo_bytes),
                 str(r.collectives), f"{r.loss_rel_diff:.1e}"]
            )  # fmt: skip
        t.rows.append([])
    t.rows.pop()
    return t


def mem_table(rows: list[OptResult]) -> Table:
    """Peak RSS per rank (fresh process per configuration) against the model-state theory."""
    t = Table(
        "Optimizer parallel: peak RSS per rank (a fresh job per configuration) vs model state",
        ["model", "N", "candidate", "params P", "theory state", "peak RSS", "RSS growth",
         "growth/theory"],
    )  # fmt: skip
    for r in rows:
        t.rows.append(
            [r.model, n_label(r), r.name, fmt_bytes(r.param_bytes), fmt_bytes(r.state_theory),
             fmt_bytes(r.rss_peak), fmt_bytes(r.rss_growth), ratio(r.rss_growth, r.state_theory)]
        )  # fmt: skip
    return t


def _notes(rows: list[OptResult], cores: int) -> list[str]:
    r0 = rows[0]
    notes = [
        f"ms: per step (forward + backward + AdamW step + zero_grad), median of the "
        f"repetitions ({r0.reps} x {r0.steps_per_call} steps for {r0.model}), max over ranks; "
        "the eight candidates alternate within one job per N (one model after the other). "
        "/best base: over the fastest PyTorch baseline of that N; > 1: slower. cpu ms: CPU "
        "time per step of one rank's process, every thread (compute, gloo's I/O, shardwise's "
        "Python), median of the repetitions, max over ranks: with one rank per core a step "
        "cannot take less. coll ms: "
        "CommRecorder's wall time of shardwise's collectives per step (each call's min over "
        "ranks, summed), taken in a "
        "separate accounting run of a few steps, not in the timed repetitions: indicative only "
        "(under load it can exceed the median step time)",
        "sent/rank: shardwise = CommRecorder's bytes (bytes_bound of each call); PyTorch = its "
        "c10d collectives seen by a TorchDispatchMode (DDP's reducer, FSDP2 and "
        "ZeroRedundancyOptimizer dispatch allreduce_ / _allgather_base_ / _reduce_scatter_base_ "
        "/ broadcast_), priced with the same bytes_bound, the loss all-reduce included; lo/rank: "
        "measured loopback bytes per rank per step (gloo's real algorithms: its reduce-scatter "
        "is an all-reduce, TCP headers included)",
        BOUND_FORMULA,
        f"loss rel diff: max over the first {CHECK_STEPS} steps of |loss - DDP's| / DDP's, fresh "
        "copies from the same seed-0 weights on the same batches",
        STATE_FORMULA + f". Peak RSS ({MEM_MODEL} only: the mlp's 10 MiB of model state is "
        f"below the RSS noise of a torch + gloo process): ru_maxrss after {MEM_STEPS} steps of "
        "that candidate alone in a fresh job (max over ranks); growth = peak - ru_maxrss before "
        "the network was built (includes gathered weights, full-size gradient buckets, "
        "communication buffers, AdamW temporaries and allocator slack, which the theory leaves "
        "out)",
    ]
    return notes + common.oversubscribed_notes(rows, cores)


def calls_text(rows: list[OptResult]) -> str:
    """Each (model, N, candidate)'s collectives in order."""
    return common.calls_text(f"{r.model} N={n_label(r)} {r.name}: {r.calls}" for r in rows)


def ranks_for(config: BenchConfig) -> tuple[int, ...]:
    """N = 2, 4 for the default ``--ranks``; otherwise ``--ranks`` (each must divide 16)."""
    why = "optimizer_parallel: --ranks {bad}: N must divide the batch (16)"
    return common.ranks_for(config, lambda n: 16 % n != 0, why)


def _with_memory(got: list[dict[str, Any]], n: int, config: BenchConfig) -> list[OptResult]:
    """Rank 0's rows of one timing job, each measured `MEM_MODEL` configuration with its peak
    RSS from a fresh `mem_worker` job (``--quick``: `QUICK_MEM` only)."""
    mem_names = QUICK_MEM if config.quick else CANDIDATES
    rows = []
    for g in got:
        if g["model"] == MEM_MODEL and g["name"] in mem_names:
            args = {"model": MEM_MODEL, "name": g["name"], "quick": config.quick}
            mem = spawn("bench.optimizer_parallel:mem_worker", n, args, config.timeout_s)
            g["rss_peak"] = max(x["rss_peak"] for x in mem)
            g["rss_growth"] = max(x["rss_growth"] for x in mem)
        rows.append(OptResult(**g))
    return rows


def run(config: BenchConfig) -> str:
    """One timing job per N (both models), one memory job per wide configuration; print and
    save the tables; return the printed text."""
    jobs = common.jobs("optimizer_parallel", config, ranks_for(config), {"quick": config.quick})
    rows = [r for n, got in jobs for r in _with_memory(got[0], n, config)]
    tables = [time_table([r for r in rows if r.model == m], m, config.quick) for m in MODELS]
    mem = mem_table([r for r in rows if r.model == MEM_MODEL])
    mem.notes = _notes(rows, os.cpu_count() or 1)
    text = "\n\n".join([*map(str, tables), str(mem), calls_text(rows)])
    data = {
        "meta": common.report_meta(config, lr=LR, shapes=shapes(config.quick),
                                   state_formula=STATE_FORMULA, bound_formula=BOUND_FORMULA),
        "rows": [asdict(r) for r in rows],
    }  # fmt: skip
    harness.save_report(config.out_dir, "optimizer_parallel", data, text)
    return text
