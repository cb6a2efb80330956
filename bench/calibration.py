"""Calibration of the planners' cost model (`shardwise.planner.CostModel`) on this machine.

Run by `bench.loopback.run` after its ping-pong (`worker`: one 2-rank job for the compute and
the collectives, then a 4-rank job for the collectives); the numbers go into ``loopback.json``
under ``compute`` and ``collective``, where `shardwise.planner.load_cost_model` reads them.

- `compute_worker` (every rank of a 2-rank job, so that both cores are busy and each rank has
  the threads a rank of a job gets): `matmul_rate` (float32 ``F.linear`` forward and backward
  at three training shapes, one of them a thin batch: FLOP/s, the median of the three),
  `traffic_fit` (chains of layer_norm, gelu and a scalar multiply, forward and backward, at
  four sizes: a line through the seconds per op against the bytes each op reads and writes),
  `executor_op_s` (a chain through ``sw.AutoParallel`` at two depths: what one more op adds to
  a training step) and `optimizer_fit` (AdamW's step: seconds per parameter and per element).
- `collectives_worker` (2 and 4 ranks): shardwise's AllReduce, AllGather, ReduceScatter and
  AlltoAll (``sw.ops``) at block sizes 64 B .. 4 MiB: what a call adds to a loop that computes
  between calls (as a training step does), and a call in a tight loop of calls.
- `fit_collectives`: weighted least squares of t = call + rounds · alpha + sent · beta
  (rounds and sent bytes as `CostModel.collective` counts them), of the forms without
  ``call`` and without ``alpha``, and with alpha fixed at the ping-pong's one-way latency, on the
  jobs with no more ranks than cores, with their relative residuals per N (the oversubscribed
  jobs' too).

Times are the 10th percentile of the repetitions (other processes only ever add time); the
compute's are the measuring thread's CPU time (what it costs on a core, without the time spent
waiting for one), the collectives' wall-clock time.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.harness import KiB, MiB

COLLECTIVE_KINDS = ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll")
COLLECTIVE_SIZES = [64, 4 * KiB, 64 * KiB, MiB, 4 * MiB]
QUICK_COLLECTIVE_SIZES = [64, 64 * KiB]
MATMUL_SHAPES = [(1024, 512, 512), (2048, 256, 768), (32, 512, 2048)]  # (rows, in, out)
QUICK_MATMUL_SHAPES = [(64, 64, 64)]
TRAFFIC_ROWS = [4, 64, 1024, 4096]  # x 256 columns: 1 Ki .. 1 Mi elements
QUICK_TRAFFIC_ROWS = [4, 64]
WIDTH = 256


def _low(samples: Sequence[float]) -> float:
    """The 10th percentile of `samples`."""
    ordered = sorted(samples)
    return ordered[len(ordered) // 10]


def _timed(fn: Callable[[], object], reps: int, calls: int = 1) -> float:
    """CPU seconds of this thread per call of `fn` (torch runs a rank's one intra-op thread on
    the caller's): the 10th percentile over `reps` loops of `calls` calls. CPU time leaves out
    the time the thread waits for a core while other processes run."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        samples.append((time.thread_time() - start) / calls)
    return _low(samples)


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of y = a + x · b by least squares on relative residuals (weights
    1/y^2), so that the small and the large points count alike."""
    w = [1.0 / y**2 for _, y in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, points, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    return (sy - slope * sx) / sw, slope


# --------------------------------------------------------------------------- compute


def matmul_rate(quick: bool) -> list[list[float]]:
    """[[rows, in, out, FLOP/s], ...] of float32 ``F.linear`` (bias included) per shape, forward
    and backward (the input's and the weight's gradients: three times the forward's FLOPs), as
    a training step runs it."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    out = []
    for rows, k, n in QUICK_MATMUL_SHAPES if quick else MATMUL_SHAPES:
        x = torch.randn(rows, k, generator=g).requires_grad_(True)
        w = torch.randn(n, k, generator=g).requires_grad_(True)
        b = torch.randn(n, generator=g).requires_grad_(True)
        seed = torch.randn(rows, n, generator=g)

        def step(x: Any = x, w: Any = w, b: Any = b, seed: Any = seed) -> None:
            F.linear(x, w, b).backward(seed)
            x.grad = w.grad = b.grad = None

        secs = _timed(step, 3 if quick else 9)
        out.append([rows, k, n, 3 * 2 * rows * k * n / secs])
    return out


def _chain(x: Any, length: int) -> Any:
    """`length` ops cycling layer_norm, gelu, a scalar multiply (each reads and writes one
    block of x's size)."""
    import torch.nn.functional as F

    for i in range(length):
        kind = i % 3
        if kind == 0:
            x = F.layer_norm(x, (x.shape[-1],))
        elif kind == 1:
            x = F.gelu(x)
        else:
            x = x * 1.01
    return x


def traffic_fit(quick: bool) -> dict[str, Any]:
    """Seconds per op of a forward-and-backward chain against the bytes an op reads and writes
    (its input and output, float32): the fit's slope is ``traffic_s_per_byte``, its intercept
    torch's own per-op time (``torch_op_s``); ``points``: [[bytes, seconds per op], ...]."""
    import torch

    length = 6 if quick else 24
    points = []
    for rows in QUICK_TRAFFIC_ROWS if quick else TRAFFIC_ROWS:
        x0 = torch.randn(rows, WIDTH)

        def step(x0: Any = x0) -> None:
            x = x0.detach().requires_grad_(True)
            _chain(x, length).sum().backward()

        secs = _timed(step, 3 if quick else 9) / length
        points.append((2.0 * rows * WIDTH * 4, secs))
    intercept, slope = line_fit(points)
    return {"torch_op_s": intercept, "traffic_s_per_byte": slope, "points": points}


def executor_op_s(quick: bool) -> dict[str, Any]:
    """What one more op adds to a training step run by ``sw.AutoParallel``: a network of a
    scaled input and a chain of tiny ops (data parallel over the job), its step's CPU time on
    the main thread at two depths, alternating; the difference over the ops' difference
    (``op_s``)."""
    import torch
    import torch.distributed as dist

    import shardwise as sw

    n, rank = dist.get_world_size(), dist.get_rank()
    depths = (6, 18) if quick else (30, 150)
    steps: dict[int, Callable[[], object]] = {}
    for depth in depths:

        class Chain(torch.nn.Module):
            def __init__(self, length: int) -> None:
                super().__init__()
                self.scale = torch.nn.Parameter(torch.ones(WIDTH))
                self.length = length

            def forward(self, x: Any) -> Any:
                return _chain(x * self.scale, self.length).sum()

        net = Chain(depth)
        opt = torch.optim.SGD(net.parameters(), lr=0.0)

        def train(x: Any, net: Any = net, opt: Any = opt) -> Any:
            loss = net(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(train, network=net, parallel_mode="semi_auto")
        x = torch.randn(2 * n, WIDTH)[2 * rank : 2 * rank + 2]
        parallel(x)  # (plans)
        steps[depth] = functools.partial(parallel, x)
    samples: dict[int, list[float]] = {d: [] for d in depths}
    for rep in range(3 if quick else 15):
        for depth in depths if rep % 2 == 0 else depths[::-1]:
            dist.barrier()
            start = time.thread_time()
            steps[depth]()
            samples[depth].append(time.thread_time() - start)
    low = [_low(samples[d]) for d in depths]
    return {"op_s": (low[1] - low[0]) / (depths[1] - depths[0]), "depths": depths, "step_s": low}


def optimizer_fit(quick: bool) -> dict[str, Any]:
    """AdamW's step (torch's default implementation on CPU) over parameter sets of several
    counts and sizes: t = tensors · per_tensor + elements · per_element by least squares on
    relative residuals. The sets: many tiny parameters (the per-parameter cost), and 1 Mi and
    4 Mi element ones (a weight matrix of a real model: its state does not stay in the caches
    across the update's passes; a small one's does, about half as dear per element)."""
    import torch

    sets = [(8, 64), (2, 4096)] if quick else [(64, 64), (8, 1 << 20), (2, 4 << 20)]
    points = []
    for count, numel in sets:
        params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(numel)
        opt = torch.optim.AdamW(params, lr=1e-4)
        secs = _timed(opt.step, 3 if quick else 9)
        points.append((count, count * numel, secs))
    # two unknowns, no intercept: normal equations of the relative residuals
    a11 = sum((t / s) ** 2 for t, _, s in points)
    a12 = sum(t * e / s**2 for t, e, s in points)
    a22 = sum((e / s) ** 2 for _, e, s in points)
    b1 = sum(t / s for t, _, s in points)
    b2 = sum(e / s for _, e, s in points)
    det = a11 * a22 - a12 * a12
    per_tensor, per_element = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    return {
        "optimizer_s_per_tensor": max(per_tensor, 0.0),
        "optimizer_s_per_element": max(per_element, 0.0),
        "points": [list(p) for p in points],
    }


def compute_worker(args: dict[str, Any]) -> dict[str, Any]:
    """Every rank measures (both cores busy, as in a job); each returns its numbers (with
    ``quick``, tiny sizes and no `executor_op_s`: ``op_s`` is then torch's own)."""
    import torch

    quick = bool(args["quick"])
    rates = matmul_rate(quick)
    return {
        "threads": torch.get_num_threads(),
        "matmul": rates,
        "flops_per_s": statistics.median(r[-1] for r in rates),
        "traffic": traffic_fit(quick),
        "executor": {"op_s": 0.0} if quick else executor_op_s(quick),
        "optimizer": optimizer_fit(quick),
    }


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """The 2-rank calibration job: `compute_worker`, then `collectives_worker` (rank 0's
    points under ``"collectives"``)."""
    return {"compute": compute_worker(args), "collectives": collectives_worker(args)}


def combine_compute(ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The `compute` section of ``loopback.json``: each constant the median over the ranks
    (``op_s``: the executor's, or torch's own per-op time when the executor's came out below
    it, i.e. lost in noise), with every rank's measurements."""
    med = statistics.median
    torch_op = med(r["traffic"]["torch_op_s"] for r in ranks)
    executor = med(r["executor"]["op_s"] for r in ranks)
    return {
        "flops_per_s": med(r["flops_per_s"] for r in ranks),
        "op_s": executor if executor > torch_op else max(torch_op, 0.0),
        "traffic_s_per_byte": max(med(r["traffic"]["traffic_s_per_byte"] for r in ranks), 0.0),
        "optimizer_s_per_tensor": med(r["optimizer"]["optimizer_s_per_tensor"] for r in ranks),
        "optimizer_s_per_element": med(r["optimizer"]["optimizer_s_per_element"] for r in ranks),
        "torch_op_s": torch_op,
        "executor_op_s": executor,
        "threads_per_rank": ranks[0]["threads"],
        "ranks": list(ranks),
    }


# --------------------------------------------------------------------------- collectives


def _work(a: Any) -> None:
    """The compute between two collectives in `collectives_worker`: four 256 x 256 float32
    products (about 0.7 ms on one core here)."""
    for _ in range(4):
        a @ a


def collectives_worker(args: dict[str, Any]) -> list[list[Any]] | None:
    """Rank 0 returns [[kind, N, block bytes, in-step s, back-to-back s], ...] per kind and
    size: ``in-step``, what a call adds to a loop that computes between calls (`_work`), as in a
    training step, where gloo's threads have gone to sleep and the ranks arrive a little apart;
    ``back-to-back``, a call in a tight loop of calls. Each the 10th percentile of the
    repetitions, the kinds taking turns."""
    import torch
    import torch.distributed as dist

    import shardwise as sw

    n, rank = dist.get_world_size(), dist.get_rank()
    ops = {
        "AllReduce": sw.ops.AllReduce(),
        "AllGather": sw.ops.AllGather(),
        "ReduceScatter": sw.ops.ReduceScatter(),
        "AlltoAll": sw.ops.AlltoAll(n, 0, 0),
    }
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    quick, out = bool(args["quick"]), []
    calls, reps = (2, 3) if quick else (16, 7)

    def loop(body: Callable[[], object]) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            body()
        return (time.perf_counter() - start) / calls

    for nbytes in args["sizes"]:
        numel = max(nbytes // 4, n)
        numel -= numel % n
        x = torch.zeros(numel)
        for kind in COLLECTIVE_KINDS:
            for _ in range(2):
                ops[kind](x)
        work: list[float] = []
        step: dict[str, list[float]] = {kind: [] for kind in COLLECTIVE_KINDS}
        tight: dict[str, list[float]] = {kind: [] for kind in COLLECTIVE_KINDS}
        for rep in range(reps):
            work.append(loop(functools.partial(_work, a)))
            shift = rep % len(COLLECTIVE_KINDS)
            for kind in COLLECTIVE_KINDS[shift:] + COLLECTIVE_KINDS[:shift]:
                op = functools.partial(ops[kind], x)
                step[kind].append(loop(lambda op=op: (_work(a), op())))
                tight[kind].append(loop(op))
        base = _low(work)
        for kind in COLLECTIVE_KINDS:
            out.append([kind, n, numel * 4, max(_low(step[kind]) - base, 1e-7), _low(tight[kind])])
    return out if rank == 0 else None


def bytes_sent(kind: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends in a collective of `kind` on an `nbytes` block (`bytes_bound`)."""
    from shardwise.communication.recorder import bytes_bound

    return bytes_bound(kind, nbytes, n)


def _features(kind: str, n: int, nbytes: int) -> tuple[float, float, float]:
    rounds = 2 * (n - 1) if kind == "AllReduce" else n - 1
    return 1.0, float(rounds), float(bytes_sent(kind, nbytes, n))


def _solve(
    rows: list[tuple[float, ...]], ys: list[float], scale: list[float]
) -> list[float] | None:
    """Least squares of rows · c = ys with weights 1/scale^2 (normal equations,
    Gauss-Jordan)."""
    k = len(rows[0])
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for r, y, t in zip(rows, ys, scale, strict=True):
        w = 1.0 / t**2
        for i in range(k):
            b[i] += w * r[i] * y
            for j in range(k):
                a[i][j] += w * r[i] * r[j]
    for i in range(k):
        pivot = max(range(i, k), key=lambda p: abs(a[p][i]))
        if abs(a[pivot][i]) < 1e-300:
            return None
        a[i], a[pivot], b[i], b[pivot] = a[pivot], a[i], b[pivot], b[i]
        for p in range(k):
            if p != i:
                f = a[p][i] / a[i][i]
                a[p] = [x - f * y for x, y in zip(a[p], a[i], strict=True)]
                b[p] -= f * b[i]
    return [b[i] / a[i][i] for i in range(k)]


FORMS = {
    "call + rounds + bytes": (0, 1, 2),
    "rounds + bytes": (1, 2),
    "call + bytes": (0, 2),
}
PING_PONG_FORM = "call + ping-pong rounds + bytes"


def fit_collectives(
    points: Sequence[Sequence[Any]], cores: int, round_s: float | None = None
) -> dict[str, Any]:
    """Fit every form of `FORMS` on the `points` ([kind, N, bytes, seconds, ...]) whose N is at
    most `cores` (more processes than cores time-slice: their times are the scheduler's), and
    with `round_s` (the ping-pong's one-way latency) `PING_PONG_FORM`: alpha fixed at
    `round_s`, call and beta fitted. Residuals (relative) are reported for every N, fitted or
    not.

    Kept: with only N = 2 fitted (1 or 2 rounds a call: too few to tell a per-call cost from a
    per-round one) `PING_PONG_FORM`; with larger N, the form with the least RMS residual. Only
    forms whose coefficients are all >= 0 are kept (None when none is).

    Returns:
        {"call_s", "alpha_s", "beta_s_per_byte", "form", "fitted_ns", "forms": {form:
        {"coefficients", "rms": {N: RMS relative residual}, "max": {N: largest}, "valid"}}}.
    """
    fitted_ns = sorted({int(p[1]) for p in points if int(p[1]) <= cores})
    used = [p for p in points if int(p[1]) in fitted_ns] or list(points)
    feats_used = [_features(str(k), int(n), int(b)) for k, n, b, *_ in used]
    times_used = [float(p[3]) for p in used]
    feats = [_features(str(k), int(n), int(b)) for k, n, b, *_ in points]
    ys = [float(p[3]) for p in points]
    fits: dict[str, list[float]] = {}
    for name, cols in FORMS.items():
        coef = _solve([tuple(f[c] for c in cols) for f in feats_used], times_used, times_used)
        if coef is not None:
            full = [0.0, 0.0, 0.0]
            for c, v in zip(cols, coef, strict=True):
                full[c] = v
            fits[name] = full
    if round_s is not None:
        rest = [t - f[1] * round_s for f, t in zip(feats_used, times_used, strict=True)]
        coef = _solve([(f[0], f[2]) for f in feats_used], rest, times_used)
        if coef is not None:
            fits[PING_PONG_FORM] = [coef[0], round_s, coef[1]]
    forms: dict[str, Any] = {}
    for name, full in fits.items():
        errors: dict[int, list[float]] = {}
        for f, y, p in zip(feats, ys, points, strict=True):
            pred = sum(fi * ci for fi, ci in zip(f, full, strict=True))
            errors.setdefault(int(p[1]), []).append((pred - y) / y)
        forms[name] = {
            "coefficients": {"call_s": full[0], "alpha_s": full[1], "beta_s_per_byte": full[2]},
            "rms": {n: math.sqrt(sum(e * e for e in es) / len(es)) for n, es in errors.items()},
            "max": {n: max(abs(e) for e in es) for n, es in errors.items()},
            "valid": all(v >= 0 for v in full) and full[2] > 0,
        }

    def overall(name: str) -> float:
        rms = [forms[name]["rms"][n] for n in fitted_ns or forms[name]["rms"]]
        return math.sqrt(sum(v * v for v in rms) / len(rms))

    valid = [name for name in forms if forms[name]["valid"]]
    best = min(valid, key=overall) if valid else None
    if max(fitted_ns, default=0) <= 2 and PING_PONG_FORM in valid:
        best = PING_PONG_FORM
    chosen = forms[best]["coefficients"] if best else {}
    return {**chosen, "form": best, "fitted_ns": fitted_ns, "forms": forms}
