"""Leaving a job without `release()`: `init()` makes every exit clean (3 real 4-rank jobs, none
aborts at interpreter exit; without `init()`'s exit hook 2 of 12 jobs aborted with SIGABRT, so
3 jobs catch that with about 42% probability, 6 with 67% at 44 s, 9 with 81% at 67 s, 12 with
89% at 88 s; the suite's 15-minute budget decides: it reached 15 min 40 s with 6), and a rank
that raises is still the job's root cause, reported with its own traceback, at once."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from shardwise.testing import clean_env, free_port

WORKER = Path(__file__).with_name("exit_worker.py")
JOBS, AT_ONCE = 3, 3

pytestmark = pytest.mark.multiprocess


def start(log_dir: Path, mode: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "shardwise", "run", "--worker_num", "4", "--local_worker_num", "4",
        "--master_port", str(free_port()), "--log_dir", str(log_dir), "--join", "True",
        str(WORKER), mode,
    ]  # fmt: skip
    env = {**clean_env(30), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def leftovers() -> list[str]:
    """Command lines of live processes running the worker script."""
    ps = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(WORKER) in line and not line.startswith("Z")]


@pytest.mark.timeout(400)
def test_jobs_without_release_all_succeed(tmp_path: Path) -> None:
    failures: list[str] = []
    for first in range(0, JOBS, AT_ONCE):  # a few jobs at a time keeps both cores busy
        jobs = [(j, start(tmp_path / f"job{j}", "clean")) for j in range(first, first + AT_ONCE)]
        for j, proc in jobs:
            out, err = proc.communicate(timeout=120)
            if proc.returncode != 0:
                failures.append(f"job {j}: exit {proc.returncode}\n{err}")
            else:
                assert "job finished: ranks 0-3 exited with code 0" in out, out
    assert not failures, f"{len(failures)} of {JOBS} jobs failed:\n" + "\n".join(failures)
    for j in range(JOBS):
        for rank in range(4):
            log = (tmp_path / f"job{j}" / f"worker_{rank}.log").read_text()
            assert f"rank {rank} ok" in log and "terminate called" not in log, log
    assert not leftovers()


@pytest.mark.timeout(120)
def test_a_raising_rank_is_the_root_cause_with_its_traceback(tmp_path: Path) -> None:
    proc = start(tmp_path / "logs", "raise")
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 1, err
    lines = err.splitlines()
    assert lines[0].startswith("shardwise run: job failed: rank 1 failed first with"), err
    assert lines[1] == "  Traceback (most recent call last):", err
    # the others lost their peer: stopped by the launcher, or failed after rank 1 (their lost
    # peer's traceback was written when the launcher's SIGTERM came)
    also = re.findall(r"^ranks? ([\d, ]+) also failed", err, re.M)  # (ranks alike: one block)
    stopped = re.findall(r"^stopped by the launcher: ranks? ([\d, ]+) \(", err, re.M)
    named = ", ".join(also + stopped).split(", ")
    assert sorted(int(r) for r in named if r) == [0, 2, 3], err
    assert err.index("ValueError: boom from rank 1") < err.index("logs: "), err
    assert "ValueError" not in err[err.index("ValueError: boom from rank 1") + 1 :], err
    # the raising rank waited for nobody at its exit (the others never reach theirs)
    worker_1 = (tmp_path / "logs/worker_1.log").read_text()
    raised = float(re.findall(r"raising at ([\d.]+)", worker_1)[0])
    scheduler = (tmp_path / "logs/scheduler.log").read_text()
    stamp = re.findall(r"^(\S+ \S+) .*rank 1 \(pid \d+\) exited with code", scheduler, re.M)[0]
    exited = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()
    assert exited - raised < 5, f"rank 1 exited {exited - raised:.1f} s after it raised"
    assert not leftovers()
