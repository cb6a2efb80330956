"""One launcher's whole job, from rendezvous to exit code.

`run_job` runs the steps in order:

1. open ``LOG_DIR/scheduler.log`` and catch SIGINT/SIGTERM/SIGHUP/SIGQUIT (`SignalWatcher`);
2. rendezvous (`rendezvous.Rendezvous`: connect, claim a node rank, register, wait for all);
3. `_socket_ifname`: the workers' ``GLOO_SOCKET_IFNAME``; with several
   nodes, start the heartbeat (`Rendezvous.start_heartbeat`, `liveness.Heartbeat`); start the
   local workers (`supervisor.Supervisor.start`), then tell the foreground process
   (``--join False``, see `detach`) that the job is up;
4. `_monitor`: every `POLL_S` collect worker exits; the first local failure (one that did not
   merely lose a peer, waiting up to `SETTLE_S` for it: `_first_failure`; explained by
   `hang.explain` when it died in a collective that other ranks never arrived at) is
   published to the store, the other launchers' failures are read from it, signals, lost
   launchers and a lost store (`_check_store`) are handled; on any of these, every local
   worker is stopped;
5. `_finish`: after a local worker's failure, name a lost node first when there is one
   (`_lost_first`); tell the store this launcher is done (the host keeps the store up until
   every launcher is done or lost), print the report (`report.format_failure_report`) or,
   with ``--join True``, the success summary, and return the exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from shardwise.launch.config import LaunchConfig, NodeAssignment
from shardwise.launch.errors import (
    EXIT_OK,
    EXIT_RENDEZVOUS,
    EXIT_USAGE,
    EXIT_WORKER_FAILED,
    LauncherInterrupted,
    RendezvousError,
)
from shardwise.launch.liveness import lost_cause, store_lost_cause
from shardwise.launch.report import (
    RootCause,
    WorkerExit,
    first_cause,
    format_failure_report,
    format_ranks,
    format_success_summary,
    lost_peer,
    worker_root_cause,
)
from shardwise.launch.schedlog import SchedulerLog
from shardwise.launch.supervisor import Supervisor, Worker

if TYPE_CHECKING:  # rendezvous imports torch; run_job imports it after setting its log level
    from shardwise.launch.rendezvous import Rendezvous

POLL_S = 0.1
SETTLE_S = 1.0  # after a worker failed by losing a peer: how long to wait for the peer's exit
STORE_POLL_S = 0.2
FINISH_WAIT_S = 15.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals that stop the job cleanly (SIGQUIT: Ctrl-backslash in a terminal)."""

OnStarted = Callable[[NodeAssignment, list[int]], None]
"""Called once the local workers run, with this node's assignment and the workers' pids."""


class SignalWatcher:
    """Records the first stop signal instead of dying, so the workers can be stopped first."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    def pending(self) -> int | None:
        """The first stop signal received, or None."""
        return self.signum


@dataclass
class _Outcome:
    root: RootCause | None = None
    exit_code: int = EXIT_OK
    seen: float = 0.0  # time.monotonic() when a local worker's failure was seen


def run_job(cfg: LaunchConfig, on_started: OnStarted | None = None) -> int:
    """Run this launcher's part of the job (see the module docstring for the steps).

    Args:
        cfg: validated options.
        on_started: called once the workers run (``--join False`` returns to the shell then).

    Returns:
        The launcher's exit code: 0 success, 1 a worker (here or elsewhere) failed,
        3 the rendezvous failed, 128+N stopped by signal N.

    Example:
        >>> run_job(LaunchConfig("train.py", worker_num=2, local_worker_num=2, join=True))
        0
    """
    base_env = dict(os.environ)
    # Quiet torch's C++ logging in the launcher only (workers get `base_env`); set before
    # `_rendezvous` imports torch.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    try:
        log = SchedulerLog.open(cfg.log_dir, truncate=cfg.single_node)
    except OSError as e:
        _say(f"shardwise run: cannot write logs to --log_dir {cfg.log_dir}: {e}", sys.stderr)
        return EXIT_USAGE
    log.info(f"shardwise run {cfg.command_line()}")
    log.info(f"python {sys.executable}, cwd {os.getcwd()}, pid {os.getpid()}")
    if cfg.single_node and cfg.node_rank > 0:
        log.info(f"--node_rank {cfg.node_rank} ignored: every worker runs on this node")
    signals = SignalWatcher()
    joined = _rendezvous(cfg, log, signals)
    if isinstance(joined, int):
        return joined
    rdv, job = joined
    log.set_node(job.node_rank)
    log.info(
        f"rendezvous complete: node {job.node_rank} of {job.num_nodes}, ranks "
        f"{format_ranks(list(job.ranks))} of {job.worker_num}, run id {job.run_id}"
    )
    base_env.update(_socket_ifname(cfg, base_env, log))
    if job.num_nodes > 1:
        try:
            rdv.start_heartbeat()
        except RuntimeError as e:
            log.info(f"no heartbeat (store unreachable): {str(e).splitlines()[0]}")
    sup = Supervisor(log)
    started = time.monotonic()
    try:
        sup.start(cfg, job, base_env)
    except OSError as e:
        root = RootCause(f"could not start the workers: {e}", job.node_rank, log.host)
        outcome = _Outcome(_publish(rdv, root, log), EXIT_WORKER_FAILED)
        return _finish(rdv, sup, job, log, cfg, outcome, started, signals)
    try:
        if on_started is not None:
            on_started(job, [w.pid for w in sup.workers])
        outcome = _monitor(rdv, sup, job, log, signals)
        return _finish(rdv, sup, job, log, cfg, outcome, started, signals)
    except BaseException:  # a bug here must not leave workers behind
        log.info("launcher error, stopping the workers:\n" + traceback.format_exc())
        sup.stop()
        raise


def _rendezvous(
    cfg: LaunchConfig, log: SchedulerLog, signals: SignalWatcher
) -> tuple[Rendezvous, NodeAssignment] | int:
    """Step 2: the store and this node's assignment, or the exit code of a failed rendezvous."""
    from shardwise.launch.rendezvous import Rendezvous  # imports torch

    deadline = time.monotonic() + cfg.cluster_time_out
    try:
        rdv = Rendezvous.connect(cfg, log, deadline, signals.pending)
        log.set_node(rdv.claim_node_rank())
        rdv.register()
        return rdv, rdv.wait_for_all(deadline, log)
    except RendezvousError as e:
        return _fail_early(log, f"shardwise run: rendezvous failed: {e}", EXIT_RENDEZVOUS)
    except RuntimeError as e:  # torch's DistNetworkError: the store went away
        where = f"{cfg.master_addr}:{cfg.master_port}"
        message = (
            f"shardwise run: rendezvous failed: lost contact with the store at {where} (did "
            f"the launcher of node 0 exit?): {str(e).splitlines()[0]}"
        )
        return _fail_early(log, message, EXIT_RENDEZVOUS)
    except LauncherInterrupted as e:
        return _fail_early(log, f"shardwise run: {e} while waiting for the workers", e.exit_code)


def _socket_ifname(cfg: LaunchConfig, env: dict[str, str], log: SchedulerLog) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the workers: the interface that routes to
    ``--master_addr``, unless the user set it (`communication._netif`)."""
    from shardwise.communication._netif import socket_ifname_env

    chosen = socket_ifname_env(cfg.master_addr, env)
    for name, value in chosen.items():
        log.info(f"workers get {name}={value}, the interface that routes to {cfg.master_addr}")
    return chosen


def _fail_early(log: SchedulerLog, message: str, code: int) -> int:
    log.info(message)
    log.info(f"launcher exits with code {code}")
    log.close()
    _say(message, sys.stderr)
    return code


def _monitor(
    rdv: Rendezvous, sup: Supervisor, job: NodeAssignment, log: SchedulerLog, signals: SignalWatcher
) -> _Outcome:
    """Watch until every local worker exited or the job must stop; then stop the rest."""
    next_store = 0.0
    while sup.running():
        failed = [w for w in sup.poll(POLL_S) if w.returncode != 0 and not w.stop_requested]
        outcome: _Outcome | None = None
        signum = signals.pending()
        if failed:
            exit_ = _first_failure(sup, failed)
            local = _explain(worker_root_cause(exit_, job.node_rank, log.host), exit_, sup, log)
            outcome = _Outcome(_publish(rdv, local, log), EXIT_WORKER_FAILED, time.monotonic())
        elif signum is not None:
            name = signal.Signals(signum).name
            local = RootCause(
                f"the launcher of node {job.node_rank} received {name}", job.node_rank, log.host
            )
            outcome = _Outcome(_publish(rdv, local, log), 128 + signum)
        elif time.monotonic() >= next_store:
            next_store = time.monotonic() + STORE_POLL_S
            outcome = _check_store(rdv, job, log)
        if outcome is not None:
            log.info(f"job failed: {outcome.root.reason if outcome.root else '?'}")
            sup.stop()
            return outcome
    sup.sweep()
    return _Outcome()


def _first_failure(sup: Supervisor, failed: list[Worker]) -> WorkerExit:
    """The local root cause, `report.first_cause` of the failed workers: when every failure
    so far only lost a peer (`report.lost_peer`: another rank left, e.g. with ``sys.exit(3)``,
    and is exiting too), the exits of the next `SETTLE_S` count as well."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        ranks = {w.rank for w in failed}
        exits = [e for e in sup.exits() if e.rank in ranks]
        left = deadline - time.monotonic()
        if not all(lost_peer(e) for e in exits) or not sup.running() or left <= 0:
            return first_cause(exits)
        failed += [w for w in sup.poll(left) if w.returncode != 0 and not w.stop_requested]


def _explain(root: RootCause, failed: WorkerExit, sup: Supervisor, log: SchedulerLog) -> RootCause:
    """`hang.explain`: when `failed` died in a collective that some local ranks never arrived
    at, the root cause names them and where they are (asked before they are stopped)."""
    from shardwise.launch.hang import explain  # imports torch (loaded by the rendezvous)

    try:
        return explain(root, failed, sup.workers)
    except Exception as e:  # a diagnosis must never cost the report
        log.info(f"could not look for ranks that never arrived: {type(e).__name__}: {e}")
        return root


def _publish(rdv: Rendezvous, local: RootCause, log: SchedulerLog) -> RootCause:
    """Publish `local` as the job's failure; returns the job's first failure."""
    try:
        return rdv.publish_failure(local)
    except RuntimeError as e:
        log.info(f"could not publish the failure to the store: {e}")
        return local


def _check_store(rdv: Rendezvous, job: NodeAssignment, log: SchedulerLog) -> _Outcome | None:
    """Read another launcher's failure and look for launchers that stopped beating."""
    try:
        root = rdv.failure()
        lost = rdv.hb.lost() if root is None and rdv.hb is not None else []
        if lost:
            root = rdv.publish_failure(lost_cause(lost, job.node_rank, log.host))
    except RuntimeError as e:
        root = _store_lost(rdv, job, log, (str(e).splitlines() or ["?"])[0])
    return None if root is None else _Outcome(root, EXIT_WORKER_FAILED)


def _store_lost(rdv: Rendezvous, job: NodeAssignment, log: SchedulerLog, error: str) -> RootCause:
    master = next((p for p in rdv.peers() if p.node_rank == 0), None)
    where = f"{job.master_addr}:{job.master_port}"
    return store_lost_cause(master, where, error, job.node_rank, log.host)


def _lost_first(
    rdv: Rendezvous, job: NodeAssignment, log: SchedulerLog, outcome: _Outcome
) -> _Outcome:
    """A local worker's failure may only echo another node's loss (its collective lost its
    peers): wait for the other launchers' heartbeats (`Heartbeat.settle`), and when one is lost,
    or node 0's store is gone, make that the root cause."""
    root, hb = outcome.root, rdv.hb
    if hb is None or root is None or root.node_rank != job.node_rank or root.rank is None:
        return outcome
    lost = hb.settle(outcome.seen)
    if hb.error is not None and not rdv.hosting:
        cause = _store_lost(rdv, job, log, hb.error)
    elif lost:
        cause = lost_cause(lost, job.node_rank, log.host)
    else:
        return outcome
    log.info(f"root cause: {cause.reason}")
    return _Outcome(cause, outcome.exit_code, outcome.seen)


def _finish(
    rdv: Rendezvous,
    sup: Supervisor,
    job: NodeAssignment,
    log: SchedulerLog,
    cfg: LaunchConfig,
    outcome: _Outcome,
    started: float,
    signals: SignalWatcher,
) -> int:
    """Name a lost node first (`_lost_first`), mark this launcher done, keep the store up for the
    others (host), report, exit code."""
    outcome = _lost_first(rdv, job, log, outcome)
    if rdv.hb is not None and not rdv.hosting:  # before node 0 may close the store
        rdv.hb.stop()
    try:
        rdv.mark_finished()
        if rdv.hosting and job.num_nodes > 1:
            _wait_others(rdv, job, log, outcome, signals)
        if outcome.root is None:
            root = rdv.failure()
            if root is not None:
                outcome = _Outcome(root, EXIT_WORKER_FAILED)
    except RuntimeError as e:
        log.info(f"store unavailable at the end of the job: {str(e).splitlines()[0]}")
    if rdv.hb is not None:
        rdv.hb.stop()
    text, stream = "", sys.stdout
    if outcome.root is not None:
        text = format_failure_report(outcome.root, sup.exits(), job.node_rank, str(log.path))
        stream = sys.stderr
        log.info(text)
    elif cfg.join:
        text = format_success_summary(sup.exits(), time.monotonic() - started, str(cfg.log_path))
    log.info(f"job end: launcher exits with code {outcome.exit_code}")
    log.close()
    if text:  # (after the log: a closed stdout must not cost the log, nor the exit code)
        _say(text, stream)
    return outcome.exit_code


def _say(text: str, stream: TextIO) -> None:
    """Print `text` to `stream`; a closed pipe (``shardwise run ... | head -0``) is ignored,
    and `stream` then writes to ``/dev/null`` so that the interpreter's last flush does not
    fail (Python exits 120 then)."""
    try:
        print(text, file=stream, flush=True)
    except OSError:  # BrokenPipeError, or another write error of a stream the user closed
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _wait_others(
    rdv: Rendezvous,
    job: NodeAssignment,
    log: SchedulerLog,
    outcome: _Outcome,
    signals: SignalWatcher,
) -> None:
    """Host only: keep the store up until every launcher is done or lost (bounded after a
    failure)."""
    limit = time.monotonic() + FINISH_WAIT_S
    log.info(f"waiting for the other {job.num_nodes - 1} launcher(s) to finish")
    while rdv.finished_count() < job.num_nodes - len(rdv.hb.lost() if rdv.hb else []):
        if outcome.root is not None and time.monotonic() >= limit:
            log.info("the other launchers did not all finish; closing the store")
            return
        if outcome.root is None:
            found = _check_store(rdv, job, log)
            signum = signals.pending()
            if found is None and signum is not None:
                name = signal.Signals(signum).name
                local = RootCause(f"the launcher of node 0 received {name}", 0, log.host)
                found = _Outcome(_publish(rdv, local, log), 128 + signum)
            if found is not None:
                outcome.root, outcome.exit_code = found.root, found.exit_code
                limit = time.monotonic() + FINISH_WAIT_S
        time.sleep(STORE_POLL_S)
