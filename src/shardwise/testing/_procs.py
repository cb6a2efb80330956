"""Helpers for the few real multi-process tests: free ports and `shardwise run` jobs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# What launchers (ours, torchrun, mpirun, msrun, rank tables) put in a worker's environment.
LAUNCHER_VARS = frozenset(
    {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "RANK_ID", "RANK_SIZE", "RANK_TABLE_FILE", "DEVICE_ID",
    }
)  # fmt: skip
LAUNCHER_PREFIXES = ("OMPI_", "MS_", "TORCHELASTIC_", "SHARDWISE_")


def clean_env(comm_timeout_s: float = 60.0) -> dict[str, str]:
    """This process's environment without any launcher's variables (tests may themselves run
    under a launcher), with a short communication timeout so a broken test fails fast."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)
    }
    env["SHARDWISE_COMM_TIMEOUT"] = str(comm_timeout_s)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class JobResult:
    """What a `run_job` launch left: exit code, launcher output and the log folder."""

    returncode: int
    output: str
    log_dir: Path

    def worker_log(self, rank: int) -> str:
        """The text of ``worker_<rank>.log``."""
        return (self.log_dir / f"worker_{rank}.log").read_text()

    def assert_checks(self, world_size: int, names: Iterable[str]) -> None:
        """Assert the job succeeded and every rank's log has a ``CHECK <name> OK`` line for
        each of `names` (the workers print one per check they passed).

        Example:
            >>> run_job(worker, 2, logs).assert_checks(2, ["AllReduce"])  # doctest: +SKIP
        """
        logs = [self.worker_log(r) for r in range(world_size)]
        if self.returncode != 0:
            raise AssertionError(self.output + "".join(logs))
        names = list(names)
        for rank, log in enumerate(logs):
            for name in names:
                if f"CHECK {name} OK" not in log:
                    raise AssertionError(f"rank {rank} did not pass {name}:\n{log}")

    def __str__(self) -> str:
        return f"job exit {self.returncode}, logs in {self.log_dir}"


def run_job(
    script: str | os.PathLike[str],
    worker_num: int,
    log_dir: str | os.PathLike[str],
    *script_args: str,
    local_worker_num: int | None = None,
    timeout: float = 180.0,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> JobResult:
    """Run `script` under ``shardwise run --join True`` on this node and wait for it.

    Args:
        script: the worker script.
        worker_num: total workers.
        log_dir: where scheduler.log and worker_<rank>.log go.
        *script_args: passed to the script.
        local_worker_num: workers on this node (default: all).
        timeout: seconds before the launcher is killed (raises subprocess.TimeoutExpired).
        extra: more launcher options, e.g. ``("--join", "True")``.
        env: extra environment variables.

    Returns:
        A `JobResult`.

    Example:
        >>> res = run_job("examples/collectives.py", 4, tmp_path)
        >>> assert res.returncode == 0, res.output
    """
    cmd = [
        sys.executable, "-m", "shardwise", "run",
        "--worker_num", str(worker_num),
        "--local_worker_num", str(local_worker_num or worker_num),
        "--master_port", str(free_port()),
        "--log_dir", str(log_dir),
        "--join", "True",
        *extra,
        str(script), *script_args,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean_env(), **(env or {})},
    )
    return JobResult(proc.returncode, proc.stdout + proc.stderr, Path(log_dir))
