"""A collective that times out because a rank never arrived: the report names that rank first,
with its Python stack and the collective it entered last, before the ranks that timed out.
Real jobs with `SHARDWISE_COMM_TIMEOUT` = 8 s; nothing is left running afterwards."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.testing import clean_env, free_port

WORKER = Path(__file__).with_name("hang_worker.py")
TIMEOUT_S = 8

pytestmark = pytest.mark.multiprocess


def run(tmp_path: Path, workers: int, mode: str) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [
        sys.executable, "-m", "shardwise", "run", "--worker_num", str(workers),
        "--local_worker_num", str(workers), "--master_port", str(free_port()),
        "--log_dir", str(tmp_path / "logs"), "--join", "True", str(WORKER), mode,
    ]  # fmt: skip
    env = {**clean_env(TIMEOUT_S), "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return res, time.monotonic() - began


def stopped_ranks(err: str) -> set[int]:
    """The ranks the launcher's "stopped by the launcher: ranks 0-2, 5 ..." line names."""
    found = re.search(r"stopped by the launcher: ranks? ([0-9, -]+)", err)
    assert found is not None, err
    ranks: set[int] = set()
    for part in found.group(1).replace(" ", "").split(","):
        low, _, high = part.partition("-")
        if low:
            ranks.update(range(int(low), int(high or low) + 1))
    return ranks


def leftovers() -> list[str]:
    """Command lines of live processes running the worker script."""
    ps = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(WORKER) in line and not line.startswith("Z")]


@pytest.mark.timeout(150)
def test_a_rank_sleeping_in_user_code_is_named_with_its_stack(tmp_path: Path) -> None:
    res, elapsed = run(tmp_path, 4, "sleep")
    err = res.stderr
    assert res.returncode == 1, err
    lines = err.splitlines()
    assert re.fullmatch(
        r"shardwise run: job failed: rank 1 never arrived at AllReduce #2 of group world_group "
        r"\(ranks 0-3\); ranks 0, 2, 3 waited in it until rank [023] failed after [\d.]+ s",
        lines[0],
    ), err
    assert re.fullmatch(
        r"rank 1 \(pid \d+, still running\): it has entered only 1 collective\(s\) of "
        r"world_group; last collective entered: AllReduce #1 of world_group \(finished\), "
        r"entered [\d.]+ s ago",
        lines[1],
    ), err
    stack = err[err.index("its Python stack:") : err.index("failed first with")]
    assert 'hang_worker.py", line 18 in load_batch' in stack, err
    assert 'hang_worker.py", line 27 in <module>' in stack, err
    # then the rank that timed out first, with the timeout set through SHARDWISE_COMM_TIMEOUT
    assert err.index("failed first with exit code 1") > err.index("in load_batch"), err
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in err, err
    assert 1 in stopped_ranks(err), err
    assert elapsed < TIMEOUT_S + 40, f"the job took {elapsed:.1f} s"
    assert not leftovers()


@pytest.mark.timeout(150)
def test_a_rank_in_another_collective_is_named(tmp_path: Path) -> None:
    res, _ = run(tmp_path, 3, "mismatch")
    err = res.stderr
    assert res.returncode == 1, err
    lines = err.splitlines()
    assert lines[0].startswith(
        "shardwise run: job failed: rank 1 never arrived at AllReduce #2 of group world_group "
        "(ranks 0-2); ranks 0, 2 waited in it until rank "
    ), err
    assert "): it is in AllGather #2 of world_group instead; last collective entered: " in lines[1]
    assert "AllGather #2 of world_group (still inside)" in lines[1], err
    # the first rank to fail timed out, or (on a loaded host) saw the peer that timed out just
    # before it leave
    timed_out = f"Timed out waiting {TIMEOUT_S * 1000}ms" in err
    assert timed_out or "Connection closed by peer" in err, err
    assert err.count("Traceback (most recent call last):") >= 1
    assert not leftovers()
