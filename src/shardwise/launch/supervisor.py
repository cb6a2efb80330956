"""This node's worker processes: start them, watch them, stop them, leave nothing behind.

- `Supervisor.start`: one ``python script.py args`` per local worker, each in its own session
  (``start_new_session=True``, so a signal reaches its whole process group), with stdout and
  stderr in ``LOG_DIR/worker_<rank>.log``, its environment from `env.worker_env`, pinned to
  its cores with ``--bind_core`` (the launcher's thread mask is set around the fork), and, on
  Linux, killed by the kernel if the launcher itself dies (``PR_SET_PDEATHSIG``).
- `Supervisor.poll`: one thread per worker waits for it and stamps the exit time, so the
  launcher knows which rank failed *first*; `poll` collects those exits.
- `Supervisor.stop`: SIGTERM to every live worker's process group, SIGKILL after
  `STOP_GRACE_S`, then `Supervisor.sweep` kills whatever is left in the workers' groups. A
  worker that had already failed on its own (`failed_on_its_own`: it has exited, its exit not
  collected yet, or its trace file says that its script failed while it tears down) is not
  counted as stopped.
- `Supervisor.exits`: how each worker ended, as `report.WorkerExit`.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shardwise._envvars import env_seconds
from shardwise.launch._logs import describe_returncode, ends_in_traceback
from shardwise.launch.config import LaunchConfig, NodeAssignment
from shardwise.launch.env import split_cores, usable_cores, worker_env
from shardwise.launch.report import WorkerExit, ranks_label
from shardwise.launch.schedlog import SchedulerLog

STOP_GRACE_S = 5.0
KILL_WAIT_S = 3.0
_PR_SET_PDEATHSIG = 1


@dataclass
class Worker:
    """A started worker process and what is known of its end."""

    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float
    cores: list[int] | None = None
    stop_requested: bool = False
    failed_before_stop: bool = False
    stack_requested: bool = False  # the launcher sent it SIGUSR1 (`hang.explain`)
    returncode: int | None = None
    ended: float | None = None
    ended_wall: float = 0.0

    @property
    def pid(self) -> int:
        """The worker's pid (also its process group id)."""
        return self.proc.pid


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the worker when the launcher dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl: do not run orphaned
            os._exit(1)

    return preexec


def stop_grace(env: Mapping[str, str] = os.environ) -> float:
    """Seconds between SIGTERM and SIGKILL: ``$SHARDWISE_STOP_GRACE``, else `STOP_GRACE_S`.

    Raises:
        ValueError: the variable is not a number of seconds, 0 or more (names it; the
            launcher refuses it before it starts, `cli.parse_run_args`).

    Example:
        >>> stop_grace({"SHARDWISE_STOP_GRACE": "1.5"})
        1.5
    """
    return env_seconds("SHARDWISE_STOP_GRACE", STOP_GRACE_S, allow_zero=True, env=env)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to process group `pgid`; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def has_exited(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie, or reaped already), read from ``/proc``."""
    if not os.path.isdir("/proc"):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def failed_on_its_own(worker: Worker) -> bool:
    """Whether a worker whose exit the launcher has not collected yet has failed on its own:
    it has exited already, or it is failing (`is_failing`: tearing down after its error). Such
    a worker is not one the launcher stopped, even when its SIGTERM is what ends it."""
    return has_exited(worker.pid) or is_failing(worker)


def is_failing(worker: Worker) -> bool:
    """Whether the worker's script has failed: it raised, or called ``sys.exit`` with a
    failure, as its trace file says (``init()`` marks it then: `_trace.mark_failing`); for a
    worker that never called ``init()`` (no trace file of its pid), whether its log ends in an
    uncaught traceback (`ends_in_traceback`, strict: a multi-line message is not seen)."""
    from shardwise.communication._trace import read_failing, trace_path  # (torch is loaded)

    failing = read_failing(trace_path(worker.log_path), worker.pid)
    return ends_in_traceback(worker.log_path) if failing is None else failing


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, read from ``/proc``.

    Example:
        >>> group_members(os.getpgid(0)) != []
        True
    """
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


class Supervisor:
    """The local workers of one launcher.

    Example:
        >>> sup = Supervisor(SchedulerLog.open("/tmp/swrun_doc", truncate=True))
        >>> sup.running()
        []
    """

    def __init__(self, log: SchedulerLog) -> None:
        self.log = log
        self.workers: list[Worker] = []
        self._exits: queue.Queue[tuple[int, int, float, float]] = queue.Queue()

    # -- start ------------------------------------------------------------------------------
    def start(self, cfg: LaunchConfig, job: NodeAssignment, base_env: Mapping[str, str]) -> None:
        """Start this node's workers (see the module docstring).

        Args:
            cfg: the launcher's options (script, args, log dir, core binding).
            job: this node's place in the job.
            base_env: the environment the workers inherit before `worker_env` adds to it.

        Raises:
            OSError: a worker could not be started (the ones already started are stopped).
        """
        n = job.local_worker_num
        bindings: list[list[int] | None] = [None] * n
        if cfg.bind_core:
            bindings = list(split_cores(usable_cores(), n))
        preexec = _die_with_parent()
        try:
            for local_rank in range(n):
                self._start_one(cfg, job, base_env, local_rank, bindings[local_rank], preexec)
                # (watched at once: a later start's failure stops it, and sees it end)
                index = len(self.workers) - 1
                threading.Thread(
                    target=self._wait,
                    args=(index, self.workers[index].proc),
                    daemon=True,
                    name=f"wait-{self.workers[index].rank}",
                ).start()
        except OSError:
            self.stop()
            raise

    def _start_one(
        self,
        cfg: LaunchConfig,
        job: NodeAssignment,
        base_env: Mapping[str, str],
        local_rank: int,
        cores: list[int] | None,
        preexec: Callable[[], None] | None,
    ) -> None:
        rank = job.rank(local_rank)
        log_path = cfg.log_path / f"worker_{rank}.log"
        cmd = [sys.executable, cfg.script, *cfg.script_args]
        env = worker_env(base_env, job, local_rank, cores)
        from shardwise.communication._trace import TRACE_ENV, trace_path  # (torch is loaded)

        trace = trace_path(log_path)
        trace.unlink(missing_ok=True)  # a previous job's
        env[TRACE_ENV] = str(trace)
        saved = os.sched_getaffinity(0) if cores else None
        with open(log_path, "wb") as out:
            try:
                if cores:
                    os.sched_setaffinity(0, cores)  # this thread only; the fork inherits it
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            finally:
                if saved is not None:
                    os.sched_setaffinity(0, saved)
        self.workers.append(Worker(rank, local_rank, proc, log_path, time.monotonic(), cores))
        bound = f", cores {cores}" if cores else ""
        self.log.info(
            f"started rank {rank} (local rank {local_rank}) pid {proc.pid}{bound}, log {log_path}"
        )

    def _wait(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        self._exits.put((index, code, time.monotonic(), time.time()))

    # -- watch ------------------------------------------------------------------------------
    def running(self) -> list[Worker]:
        """Workers that have not exited yet."""
        return [w for w in self.workers if w.returncode is None]

    def poll(self, timeout: float) -> list[Worker]:
        """Collect worker exits, waiting up to `timeout` seconds for the first one.

        Returns:
            The workers that exited since the last call, in the order they exited.
        """
        done: list[Worker] = []
        try:
            item = self._exits.get(timeout=timeout) if timeout > 0 else self._exits.get_nowait()
            while True:
                done.append(self._record(*item))
                item = self._exits.get_nowait()
        except queue.Empty:
            pass
        return done

    def _record(self, index: int, code: int, ended: float, wall: float) -> Worker:
        w = self.workers[index]
        w.returncode, w.ended, w.ended_wall = code, ended, wall
        after = f"after {ended - w.started:.2f} s"
        if w.failed_before_stop and code == 0:
            how = "had exited before it was stopped (exit code 0)"
        elif w.failed_before_stop:
            how = f"had failed on its own before it was stopped ({describe_returncode(code)})"
        elif _ended_by_stack_request(w):
            how = "was ended by the launcher's SIGUSR1 (its request for the Python stack)"
        elif w.stop_requested:
            how = f"stopped by the launcher ({describe_returncode(code)})"
        elif code < 0:
            how = f"was killed by {describe_returncode(code)}"
        else:
            how = f"exited with code {code}"
        self.log.info(f"rank {w.rank} (pid {w.pid}) {how} {after}")
        return w

    # -- stop -------------------------------------------------------------------------------
    def stop(self, grace: float | None = None) -> None:
        """Stop every live worker: SIGTERM to its group, SIGKILL after `grace` s, then sweep.

        Args:
            grace: seconds between SIGTERM and SIGKILL; None: ``$SHARDWISE_STOP_GRACE`` or
                `STOP_GRACE_S`.
        """
        if grace is None:
            grace = stop_grace()
        self.poll(0)  # (a worker that has exited on its own is not stopped)
        alive = self.running()
        if alive:
            label = ranks_label([w.rank for w in alive])
            self.log.info(f"stopping {label}: SIGTERM to their process groups")
            for w in alive:
                w.failed_before_stop = failed_on_its_own(w)
                w.stop_requested = not w.failed_before_stop
                _signal_group(w.pid, signal.SIGTERM)
            self._wait_all(grace)
        alive = self.running()
        if alive:
            label = ranks_label([w.rank for w in alive])
            self.log.info(f"{label} still running after {grace:g} s: SIGKILL")
            for w in alive:
                _signal_group(w.pid, signal.SIGKILL)
            self._wait_all(KILL_WAIT_S)
        self.sweep()

    def _wait_all(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.running() and time.monotonic() < deadline:
            self.poll(0.05)

    def sweep(self) -> None:
        """SIGKILL what is left in the process groups of exited workers (their children)."""
        for w in self.workers:
            if w.returncode is None:
                continue
            left = group_members(w.pid)
            if left and _signal_group(w.pid, signal.SIGKILL):
                self.log.info(f"killed pids {left} left in rank {w.rank}'s process group")

    def exits(self) -> list[WorkerExit]:
        """How the exited workers ended, in rank order.

        A signal of the launcher's (SIGTERM or SIGKILL of `stop`, SIGUSR1 of `hang.explain`)
        that ended a worker which had failed on its own (`is_failing`) is not
        its failure: `WorkerExit.ended_by_launcher`; otherwise the worker counts as stopped.
        """
        ordered = sorted(self.workers, key=lambda w: w.rank)
        return [_worker_exit(w, w.returncode) for w in ordered if w.returncode is not None]


def _ended_by_stack_request(w: Worker) -> bool:
    return w.stack_requested and w.returncode == -signal.SIGUSR1


def _worker_exit(w: Worker, code: int) -> WorkerExit:
    usr1 = _ended_by_stack_request(w)
    failed = w.failed_before_stop or (usr1 and is_failing(w))
    launcher_signal = usr1 or code in (-signal.SIGTERM, -signal.SIGKILL)
    return WorkerExit(
        rank=w.rank,
        local_rank=w.local_rank,
        pid=w.pid,
        returncode=code,
        ended=w.ended_wall,
        stopped=not failed and (w.stop_requested or usr1),
        log_path=str(w.log_path),
        ended_by_launcher=failed and launcher_signal,
    )
