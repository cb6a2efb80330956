"""The benchmark harness: real gloo workers, side-by-side timing, tables.

Three parts, used by every benchmark module:

1. In the parent process: `spawn()` starts N worker processes (``python -m bench._worker``)
   with torchrun-style environment variables on a free port (`free_port`), waits for them
   with a timeout (killing every worker when one fails or time runs out: `WorkerError`)
   and returns what each rank's worker function returned (a JSON file per rank).
2. In the workers: `compare()` times several candidates in the same run, alternating their
   order every repetition after a warm-up, and returns one `Measurement` per candidate
   (median of the repetitions, max over ranks); `paired_ratio` gives two candidates'
   ratio from their paired repetitions with a confidence interval. Around every timed loop
   rank 0 reads the loopback interface's transmit counter (`lo_tx_bytes`); `barrier_bytes()`
   measures what the barrier that closes the loop adds, which `compare()` subtracts.
3. Output: `Table` (aligned text with notes), `fmt_bytes` / `fmt_ms`, `host_info()` and
   `save_report()` (JSON + the printed text into the results folder).

Benchmarks never assert a timing; they print and save them.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
KiB = 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class BenchConfig:
    """What `python -m bench` was asked to run (shared by every benchmark's `run`)."""

    ranks: tuple[int, ...] = (2, 4, 8)
    sizes: tuple[int, ...] = (64 * KiB, MiB, 8 * MiB)  # bytes of float32 per rank
    quick: bool = False
    collectives: tuple[str, ...] = ()  # empty: all
    timeout_s: float = 300.0
    out_dir: Path = REPO_ROOT / "bench" / "results"


class WorkerError(RuntimeError):
    """A worker failed or the job ran past its timeout; the message holds the log tails."""


# --------------------------------------------------------------------------- 1. spawning


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _worker_env(rank: int, world_size: int, port: int, timeout_s: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "OMPI_"))}
    for name in ("SHARDWISE_RUN", "SHARDWISE_RUN_ID", "RANK_TABLE_FILE", "GROUP_RANK"):
        env.pop(name, None)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SHARDWISE_COMM_TIMEOUT=str(timeout_s),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the traffic `lo_tx_bytes` counts
    return env


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return text[-chars:]


def _wait(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float) -> None:
    """Wait for every worker; on a failure or the timeout kill them all and raise."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            rank = failed[0] if failed else 0
            why = f"rank {rank} exited with code {codes[rank]}" if failed else "timed out"
            raise WorkerError(
                f"{why} ({timeout_s:.0f}s limit); rank {rank}'s log:\n{_tail(logs[rank])}"
            )
        if all(c == 0 for c in codes):
            return
        time.sleep(0.05)


def spawn(target: str, world_size: int, args: Mapping[str, Any], timeout_s: float) -> list[Any]:
    """Run ``target(args)`` on `world_size` real gloo ranks and return each rank's result.

    Args:
        target: ``"module:function"``; the function takes the JSON `args` dict and returns
            something JSON-serializable. It runs after ``shardwise.communication.init("gloo")``.
        world_size: number of worker processes (ranks).
        args: JSON-serializable arguments, the same on every rank.
        timeout_s: wall-clock limit for the whole job (also the collectives' timeout).

    Raises:
        WorkerError: a worker exited non-zero or the job ran past `timeout_s`.
    """
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as tmp:
        work = Path(tmp)
        spec = {"target": target, "args": dict(args), "result_dir": str(work)}
        (work / "spec.json").write_text(json.dumps(spec))
        port = free_port()
        logs = [work / f"worker_{r}.log" for r in range(world_size)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for r in range(world_size):
                with logs[r].open("wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "bench._worker", str(work / "spec.json")],
                            env=_worker_env(r, world_size, port, timeout_s),
                            cwd=REPO_ROOT,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
            _wait(procs, logs, timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [json.loads((work / f"rank{r}.json").read_text()) for r in range(world_size)]


# --------------------------------------------------------------------------- 2. timing


def lo_tx_bytes() -> int | None:
    """Bytes transmitted so far on the loopback interface (``/proc/net/dev``), None if unknown."""
    try:
        lines = Path("/proc/net/dev").read_text().splitlines()
    except OSError:
        return None
    for line in lines[2:]:
        name, _, data = line.partition(":")
        if name.strip() == "lo":
            return int(data.split()[8])
    return None


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def barrier_bytes(reps: int = 7) -> float | None:
    """Median loopback bytes (all ranks together) of the two barriers that frame each timed
    loop of `compare()`, measured the same way (rank 0 reads, barrier, barrier, rank 0 reads).
    Call on every rank; None when ``/proc/net/dev`` is unreadable."""
    import torch
    import torch.distributed as dist

    samples = []
    for _ in range(reps):
        before = lo_tx_bytes()
        dist.barrier()
        dist.barrier()
        samples.append(_delta(before, lo_tx_bytes()))
    unreadable = torch.tensor([int(dist.get_rank() == 0 and None in samples)])
    dist.all_reduce(unreadable)  # every rank learns whether rank 0 could read the counter
    if unreadable.item():
        return None
    return float(statistics.median(d for d in samples if d is not None))


@dataclass
class Measurement:
    """One candidate's repetitions: seconds and process CPU seconds per call (each the max over
    ranks) and loopback bytes per rank per call (rank 0's reading of the whole host's ``lo``
    counter, barriers subtracted; empty on the other ranks)."""

    name: str
    seconds: list[float] = field(default_factory=list)
    lo_bytes: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # process CPU per call, max over ranks

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_cpu_s(self) -> float:
        """CPU seconds per call of the busiest rank's process (all its threads: compute and
        gloo's I/O), median of the repetitions: with as many ranks as cores the step can be no
        shorter than this."""
        return statistics.median(self.cpu_seconds)

    @property
    def median_lo_bytes(self) -> float | None:
        return statistics.median(self.lo_bytes) if self.lo_bytes else None

    def __str__(self) -> str:
        lo = self.median_lo_bytes
        return f"{self.name}: {fmt_ms(self.median_s)} ms, lo {fmt_bytes(lo)}/rank"


def paired_ratio(a: Measurement, b: Measurement, level: float = 0.95) -> Ratio:
    """The step-time ratio ``a / b`` from paired repetitions: each repetition's ``a`` and ``b``
    ran in the same round of `compare` (one call of every candidate, the order alternating), so
    host noise that lasts longer than a round cancels in their ratio. The median of the
    per-repetition ratios, and a distribution-free `level` confidence interval for that median
    (order statistics of a binomial(n, 1/2) count; none with fewer than 6 repetitions at 95 %).

    Example:
        >>> a, b = Measurement("a", seconds=[1.0] * 9), Measurement("b", seconds=[2.0] * 9)
        >>> str(paired_ratio(a, b))
        '0.50 (0.50-0.50)'
    """
    ratios = sorted(x / y for x, y in zip(a.seconds, b.seconds, strict=True))
    n = len(ratios)
    k, tail = 0, 0.0  # the CI is ratios[k - 1 : n - k + 1] (1-based k-th and (n+1-k)-th)
    while True:
        tail += math.comb(n, k) / 2**n  # P(count <= k)
        if 2 * tail > 1 - level:
            break
        k += 1
    median = statistics.median(ratios)
    if k == 0:
        return Ratio(median, None, None)
    return Ratio(median, ratios[k - 1], ratios[n - k])


@dataclass(frozen=True)
class Ratio:
    """A paired ratio (`paired_ratio`): median and confidence bounds (None: too few
    repetitions for one)."""

    median: float
    low: float | None
    high: float | None

    def __str__(self) -> str:
        if self.low is None or self.high is None:
            return f"{self.median:.2f}"
        return f"{self.median:.2f} ({self.low:.2f}-{self.high:.2f})"


def _timed(
    fn: Callable[[], object], iters: int, barrier: float | None
) -> tuple[float, float | None, float]:
    """One repetition on this rank: (seconds per call; loopback bytes per rank per call on
    rank 0, None elsewhere; this process's CPU seconds per call, every thread).

    Rank 0 reads the counter *before* the opening barrier: no rank can send a byte of the
    loop before rank 0 has read it (others would otherwise start an all-to-all while rank 0
    still waits for a core). It reads again after the closing barrier, when every rank has
    received all its data. The two barriers' bytes (`barrier`) are subtracted.
    """
    import torch.distributed as dist

    read = dist.get_rank() == 0 and barrier is not None
    before = lo_tx_bytes() if read else None
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    dist.barrier()
    moved = _delta(before, lo_tx_bytes() if read else None)
    if moved is None or barrier is None:
        return elapsed / iters, None, cpu / iters
    return elapsed / iters, (moved - barrier) / dist.get_world_size() / iters, cpu / iters


def compare(
    candidates: Mapping[str, Callable[[], object]],
    *,
    iters: int,
    reps: int,
    warmup: int = 1,
    barrier: float | None = None,
) -> dict[str, Measurement]:
    """Time the candidates side by side: warm-up, then `reps` repetitions of `iters` calls each,
    the order alternating every repetition. Call on every rank with the same arguments.

    Args:
        candidates: name -> a no-argument function issuing the work once (same order on every
            rank).
        barrier: `barrier_bytes()`, subtracted from each loopback reading (None: no reading).

    Returns:
        name -> `Measurement`; the seconds and CPU seconds are the max over ranks (one
        all-reduce at the end, so no collective but the candidates' runs between two readings
        of the counter).
    """
    import torch
    import torch.distributed as dist

    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    out = {name: Measurement(name) for name in candidates}
    names = list(candidates)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            seconds, lo, cpu = _timed(candidates[name], iters, barrier)
            out[name].seconds.append(seconds)
            out[name].cpu_seconds.append(cpu)
            if lo is not None:
                out[name].lo_bytes.append(lo)
    slowest = torch.tensor(
        [s for m in out.values() for s in (*m.seconds, *m.cpu_seconds)], dtype=torch.float64
    )
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    for i, m in enumerate(out.values()):
        m.seconds = slowest[2 * i * reps : (2 * i + 1) * reps].tolist()
        m.cpu_seconds = slowest[(2 * i + 1) * reps : (2 * i + 2) * reps].tolist()
    return out


# --------------------------------------------------------------------------- 3. output


def fmt_bytes(n: float | None) -> str:
    """``1.5 MiB``-style; ``n/a`` for None."""
    if n is None:
        return "n/a"
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_ms(seconds: float) -> str:
    """Milliseconds with three significant-ish decimals."""
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


@dataclass
class Table:
    """Aligned text: a title, a header, rows (first column left-aligned), notes underneath."""

    title: str
    headers: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        cells = [list(self.headers), *[list(r) for r in self.rows]]
        widths = [max(len(row[i]) for row in cells if row) for i in range(len(self.headers))]

        def line(row: Sequence[str]) -> str:
            if not row:
                return ""
            parts = [row[0].ljust(widths[0])] + [
                c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
            ]
            return "  ".join(parts).rstrip()

        rule = "-" * len(line(self.headers))
        body = [line(r) for r in cells[1:]]
        notes = [
            textwrap.fill(n, 100, initial_indent="  ", subsequent_indent="    ") for n in self.notes
        ]
        return "\n".join([self.title, rule, line(self.headers), rule, *body, rule, *notes])


def host_info() -> dict[str, Any]:
    """Host name, cores, load average, Python and torch versions (saved with every result)."""
    import torch

    return {
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count() or 1,
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def save_report(out_dir: Path, name: str, data: Mapping[str, Any], text: str) -> list[Path]:
    """Write ``<name>.json`` and ``<name>.txt`` into `out_dir`; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.txt"]
    paths[0].write_text(json.dumps(data, indent=2, default=str) + "\n")
    paths[1].write_text(text + "\n")
    return paths
