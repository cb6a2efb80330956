"""``--join``: whether the command waits for the job (True) or returns once it runs (False).

`launch` is the entry of both modes. Following msrun, ``--join False`` (the default) gives the
shell back as soon as the workers run; unlike msrun's workers, ours are never left
unsupervised: `run_detached` forks *before* the rendezvous, and the child (in its own
session, so a Ctrl-C in the shell does not reach it) runs the whole job (`job.run_job`): it
hosts or joins the store, starts and watches the workers, stops them all on the first
failure and writes the report to ``scheduler.log``. The foreground process waits on a pipe
for one message: "started" (it prints the supervisor's pid and returns 0) or "exit"
(rendezvous failed: the child already printed why; its code is returned).

After "started" the supervisor's stdin/stdout/stderr go to ``/dev/null``, except a stdout or
stderr that is a terminal: there the failure report still appears.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from shardwise.launch.config import LaunchConfig, NodeAssignment
from shardwise.launch.errors import EXIT_WORKER_FAILED
from shardwise.launch.job import STOP_SIGNALS, run_job
from shardwise.launch.report import ranks_label


def launch(cfg: LaunchConfig) -> int:
    """Run the job in the foreground (``join=True``) or return once it runs (``join=False``).

    Args:
        cfg: validated options.

    Returns:
        The exit code for the shell.

    Example:
        >>> launch(LaunchConfig("train.py", worker_num=2, local_worker_num=2, join=True))
        0
    """
    if cfg.join:
        return run_job(cfg)
    return run_detached(cfg)


def run_detached(cfg: LaunchConfig) -> int:
    """Fork a background supervisor for the job; return when its workers run.

    Returns:
        0 once the workers run; the supervisor's exit code when it ended before that.
    """
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _supervise(cfg, write_fd)
    os.close(write_fd)
    return _wait_for_start(pid, read_fd, cfg)


def _send(fd: int, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the foreground process is gone: nothing to tell
        os.write(fd, (json.dumps(message) + "\n").encode())


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    for fd in (1, 2):
        if not os.isatty(fd):
            os.dup2(devnull, fd)
    os.close(devnull)


def _supervise(cfg: LaunchConfig, fd: int) -> NoReturn:
    """The forked child: run the job, report "started" through `fd`, never return."""
    pipe = [fd]

    def started(job: NodeAssignment, pids: list[int]) -> None:
        message = {
            "event": "started",
            "pid": os.getpid(),
            "node_rank": job.node_rank,
            "num_nodes": job.num_nodes,
            "ranks": list(job.ranks),
        }
        _send(pipe[0], message)
        os.close(pipe.pop())
        sys.stdout.flush()
        sys.stderr.flush()
        _detach_stdio()

    code = EXIT_WORKER_FAILED
    try:
        os.setsid()
        code = run_job(cfg, started)
    except BaseException:
        traceback.print_exc()
    finally:
        if pipe:
            _send(pipe[0], {"event": "exit", "code": code})
            os.close(pipe.pop())
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def started_text(message: Mapping[str, Any], log_path: Path) -> str:
    """What ``--join False`` prints once the background supervisor's workers run.

    Args:
        message: the supervisor's "started" message (``pid``, ``node_rank``, ``num_nodes``,
            ``ranks``).
        log_path: the job's log folder.

    Example:
        >>> m = {"pid": 7, "node_rank": 0, "num_nodes": 2, "ranks": [0]}
        >>> started_text(m, Path("log")).splitlines()[0]
        'shardwise run: 1 worker started (rank 0, node 0 of 2), supervised in the background by \
pid 7 (--join False)'
    """
    ranks = message["ranks"]
    return (
        f"shardwise run: {len(ranks)} worker{'s' if len(ranks) != 1 else ''} started "
        f"({ranks_label(ranks)}, node {message['node_rank']} of {message['num_nodes']}), "
        f"supervised in the background by pid {message['pid']} (--join False)\n"
        f"  progress and failures: {log_path}/scheduler.log; output: "
        f"{log_path}/worker_<rank>.log\n"
        f"  stop the job: kill {message['pid']}"
    )


def _wait_for_start(pid: int, fd: int, cfg: LaunchConfig) -> int:
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)  # (as received: Ctrl-C is reported as SIGINT, 130)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    with os.fdopen(fd, "rb") as pipe:
        lines = pipe.read().decode(errors="replace").splitlines()
    message: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    if message.get("event") == "started":
        print(started_text(message, cfg.log_path), flush=True)
        return 0
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if not message:
        print(
            f"shardwise run: the launcher's background process ended ({code}) before the "
            f"workers started; see {cfg.log_path}/scheduler.log",
            file=sys.stderr,
        )
        code = code if code > 0 else EXIT_WORKER_FAILED
    else:
        code = int(message.get("code", code))
    return 128 + received[0] if received else code
