"""`shardwise run` end to end with real processes: logs, the failure report (root cause first),
no orphans after a failure or a signal, the rendezvous timeout, a two-launcher job whose workers
all-reduce through `shardwise.communication.init()`, and `--join False`.

Worker scripts are in workers/; only allreduce.py imports torch. Every test picks a free port.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.testing import clean_env, free_port

WORKERS = Path(__file__).with_name("workers")

pytestmark = pytest.mark.multiprocess


def swrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardwise.launch", *args]


def start_launcher(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        swrun_cmd(*args),
        cwd=cwd,
        env=clean_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def two_nodes(port: str, node_rank: str, log_dir: str) -> list[str]:
    """Options of one of two launchers on this machine forming a 4-worker job."""
    return [
        "--worker_num", "4", "--local_worker_num", "2", "--master_addr", "127.0.0.1",
        "--master_port", port, "--node_rank", node_rank, "--log_dir", log_dir,
        "--join", "True", "--cluster_time_out", "60",
    ]  # fmt: skip


def swrun(tmp: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        swrun_cmd(*args), cwd=tmp, env=clean_env(), capture_output=True, text=True, timeout=timeout
    )


def job_args(workers: int, log_dir: Path, *more: str, local: int | None = None) -> list[str]:
    return [
        "--worker_num", str(workers), "--local_worker_num", str(local or workers),
        "--master_port", str(free_port()), "--log_dir", str(log_dir), *more,
    ]  # fmt: skip


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def survivors(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and _state(int(entry)) not in ("Z", "X", "gone"):
            found.append(int(entry))
    return found


def assert_no_orphans(marker: str, pid_dir: Path) -> None:
    """Every worker (its argv has `marker`) and every child of one (likewise) is gone."""
    recorded = [int(p) for f in pid_dir.glob("*.pids") for p in f.read_text().split()]
    assert len(recorded) >= 4, "the workers did not record their pids"
    left = survivors(marker)
    assert not left, f"processes outlived the job: {left} (workers and children: {recorded})"


def seconds_of(scheduler_log: str, text: str) -> float:
    """The time of the first scheduler.log line containing `text`, in seconds of the day."""
    line = next(line for line in scheduler_log.splitlines() if text in line)
    hours, minutes, seconds = line.split()[1].split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def wait_for(path: Path, text: str, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and text in (content := path.read_text()):
            return content
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} after {seconds} s")


@pytest.mark.timeout(60)
def test_four_workers_finish_with_their_logs(tmp_path: Path) -> None:
    logs = tmp_path / "logs"  # created by the launcher
    args = job_args(4, logs, "--join", "True", "--bind_core", "True")
    res = swrun(tmp_path, *args, str(WORKERS / "echo_env.py"), "--lr", "0.1", "--join", "x")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "job finished: ranks 0-3 exited with code 0" in res.stdout
    scheduler = (logs / "scheduler.log").read_text()
    assert "shardwise run --worker_num 4" in scheduler and "job end" in scheduler
    for rank in range(4):
        out = (logs / f"worker_{rank}.log").read_text()
        assert f"hello from rank {rank} of 4" in out
        assert json.loads(out.split("ARGV ")[1].splitlines()[0]) == ["--lr", "0.1", "--join", "x"]
        env = json.loads(out.split("ENV ")[1].splitlines()[0])
        assert env == {"LOCAL_RANK": str(rank), "GROUP_RANK": "0", "RANK_ID": str(rank)}
        started = re.search(
            rf"started rank {rank} \(local rank {rank}\) pid (\d+), cores (\[.*?\])", scheduler
        )
        assert started, scheduler
        assert json.loads(started.group(2)) == json.loads(out.split("CORES ")[1].splitlines()[0])
        assert re.search(rf"rank {rank} \(pid {started.group(1)}\) exited with code 0", scheduler)
    cores = [
        json.loads(re.findall(rf"started rank {r} .*cores (\[.*?\])", scheduler)[0])
        for r in range(4)
    ]
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) >= 4:  # disjoint sets; with fewer cores than workers they are shared
        assert sorted(c for cs in cores for c in cs) == usable


@pytest.mark.timeout(60)
def test_exception_stops_the_job_and_names_the_root_cause(tmp_path: Path) -> None:
    marker, pid_dir = f"swtest-{tmp_path.name}-exc", tmp_path
    start = time.monotonic()
    res = swrun(
        tmp_path,
        *job_args(4, tmp_path / "logs", "--join", "True"),
        str(WORKERS / "fail_one.py"), "1", "exception", marker, str(pid_dir),
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr
    first = err.splitlines()[0]
    assert "rank 1 failed first with exit code 1" in first, err
    assert err.index("ValueError: boom from rank 1") < err.index("stopped by the launcher")
    assert "Traceback (most recent call last):" in err and 'fail_one.py", line' in err
    assert "stopped by the launcher: ranks 0, 2, 3" in err
    assert f"logs: {tmp_path / 'logs' / 'worker_1.log'}" in err
    assert elapsed < 45, f"the launcher took {elapsed:.1f} s"
    assert_no_orphans(marker, pid_dir)
    scheduler = (tmp_path / "logs" / "scheduler.log").read_text()
    stopping = seconds_of(scheduler, "job failed: rank 1")
    assert seconds_of(scheduler, "job end") - stopping < 10, scheduler
    assert "rank 1 (pid" in scheduler and "exited with code 1" in scheduler
    assert "stopped by the launcher (signal SIGTERM)" in scheduler


@pytest.mark.timeout(60)
def test_workers_ignoring_sigterm_are_killed(tmp_path: Path) -> None:
    marker = f"swtest-{tmp_path.name}-stubborn"
    script = [str(WORKERS / "fail_one.py"), "0", "exception", marker, str(tmp_path), "0.5"]
    res = subprocess.run(
        swrun_cmd(*job_args(2, tmp_path / "logs", "--join", "True"), *script, "stubborn"),
        cwd=tmp_path,
        env={**clean_env(), "SHARDWISE_STOP_GRACE": "1"},
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert res.returncode == 1, res.stderr
    assert "rank 0 failed first with exit code 1" in res.stderr.splitlines()[0]
    assert "stopped by the launcher: rank 1 (ended by SIGKILL)" in res.stderr
    assert (
        "rank 1 still running after 1 s: SIGKILL" in (tmp_path / "logs/scheduler.log").read_text()
    )
    assert_no_orphans(marker, tmp_path)


@pytest.mark.timeout(60)
def test_worker_killed_by_a_signal_is_named(tmp_path: Path) -> None:
    marker = f"swtest-{tmp_path.name}-kill"
    res = swrun(
        tmp_path,
        *job_args(3, tmp_path / "logs", "--join", "True"),
        str(WORKERS / "fail_one.py"), "2", "sigkill", marker, str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rank 2 failed first with signal SIGKILL" in res.stderr.splitlines()[0]
    assert "no traceback in worker_2.log; its last lines:\n  rank 2 ready" in res.stderr
    assert_no_orphans(marker, tmp_path)


@pytest.mark.timeout(60)
def test_missing_workers_time_out_with_a_clear_message(tmp_path: Path) -> None:
    args = job_args(4, tmp_path / "logs", "--cluster_time_out", "2", local=2)
    start = time.monotonic()
    res = swrun(tmp_path, *args, str(WORKERS / "echo_env.py"))
    assert res.returncode == 3, res.stdout + res.stderr
    assert time.monotonic() - start < 15
    assert "only 2 of 4 workers joined after 2 s" in res.stderr
    assert "start the other launchers with --node_rank 1" in res.stderr
    assert "--master_port" in res.stderr
    assert not list((tmp_path / "logs").glob("worker_*.log"))  # no worker started


@pytest.mark.timeout(90)
def test_two_launchers_form_one_job_and_all_reduce(tmp_path: Path) -> None:
    port = str(free_port())
    script = str(WORKERS / "allreduce.py")
    procs = [  # the client first: it waits for node 0's store
        start_launcher(tmp_path, *two_nodes(port, str(node), f"node{node}"), script)
        for node in (1, 0)
    ]
    try:
        outputs = [p.communicate(timeout=80) for p in procs]
    finally:
        for p in procs:
            p.kill()  # no-op when it ended; its workers die with it (PR_SET_PDEATHSIG)
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out + err
    for rank in range(4):
        node = rank // 2
        log = (tmp_path / f"node{node}" / f"worker_{rank}.log").read_text()
        assert f"rank {rank} of 4 (local {rank % 2}) sum 6" in log, log
        scheduler = (tmp_path / f"node{node}" / "scheduler.log").read_text()
        assert f"rendezvous complete: node {node} of 2" in scheduler


@pytest.mark.timeout(60)
def test_a_failure_on_one_node_stops_the_other_node(tmp_path: Path) -> None:
    marker, port = f"swtest-{tmp_path.name}-2n", str(free_port())
    script = [str(WORKERS / "fail_one.py"), "3", "exception", marker, str(tmp_path), "1"]
    procs = [
        start_launcher(tmp_path, *two_nodes(port, "-1", f"node{node}"), *script) for node in (0, 1)
    ]
    try:
        errs = [p.communicate(timeout=45)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1], errs
    local = next(e for e in errs if e.startswith("shardwise run: job failed: rank 3 failed first"))
    remote = next(e for e in errs if e is not local)
    assert re.match(r"shardwise run: job failed on node 1 \(.*\): rank 3 failed first", remote)
    for text in (local, remote):
        assert "ValueError: boom from rank 3" in text
    assert "stopped by the launcher: rank 2" in local
    assert "stopped by the launcher: ranks 0, 1" in remote
    assert "worker_3.log (on " in remote
    assert_no_orphans(marker, tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGQUIT], ids=lambda s: s.name)
def test_a_stop_signal_to_the_launcher_stops_every_worker(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGQUIT (Ctrl-backslash) too: the launcher used to die at once, leaving no report and
    the workers' children behind."""
    marker, logs = f"swtest-{tmp_path.name}-term", tmp_path / "logs"
    proc = start_launcher(
        tmp_path,
        *job_args(2, logs, "--join", "True"),
        str(WORKERS / "fail_one.py"), "-1", "exception", marker, str(tmp_path),
    )  # fmt: skip
    try:
        wait_for(logs / "worker_1.log", "ready", 30)
        wait_for(logs / "worker_0.log", "ready", 5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"the launcher of node 0 received {sig.name}" in err.splitlines()[0]
    assert "stopped by the launcher: ranks 0, 1" in err
    assert_no_orphans(marker, tmp_path)


@pytest.mark.timeout(60)
def test_join_false_returns_and_supervises_in_the_background(tmp_path: Path) -> None:
    marker, logs = f"swtest-{tmp_path.name}-bg", tmp_path / "logs"
    res = swrun(
        tmp_path,
        *job_args(2, logs, "--join", "False"),
        str(WORKERS / "fail_one.py"), "0", "exception", marker, str(tmp_path), "2",
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 workers started (ranks 0, 1, node 0 of 1)" in res.stdout
    supervisor = int(re.findall(r"kill (\d+)", res.stdout)[0])
    assert "job end" not in (logs / "scheduler.log").read_text()  # the shell got control back
    scheduler = wait_for(logs / "scheduler.log", "job end", 30)
    assert "rank 0 failed first with exit code 1" in scheduler
    assert "ValueError: boom from rank 0" in scheduler
    assert "launcher exits with code 1" in scheduler
    deadline = time.monotonic() + 5
    while _state(supervisor) not in ("Z", "X", "gone") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(supervisor) in ("Z", "X", "gone"), "the background supervisor is still running"
    assert_no_orphans(marker, tmp_path)
