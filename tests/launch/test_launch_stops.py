"""Which ranks failed when the launcher stopped a job, and what their logs show: a rank that
had failed on its own (its trace file's failing flag, or strict log text without init()), one
that left with code 0, a closed stdout, native crashes and crash dumps after a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.launch.test_launch_report import TB, _exit

from shardwise.launch._logs import log_excerpt
from shardwise.launch.report import (
    format_failure_report,
    worker_root_cause,
)


def test_a_rank_tearing_down_after_its_traceback_failed_with_the_same_error(
    tmp_path: Path,
) -> None:
    """Every rank raised the same error; rank 1 was still tearing down after its traceback
    when rank 0's failure made the launcher send SIGTERM. Rank 1 failed with the same error:
    it was listed as stopped by the launcher."""
    from shardwise.launch.config import LaunchConfig, NodeAssignment
    from shardwise.launch.schedlog import SchedulerLog
    from shardwise.launch.supervisor import Supervisor

    script = tmp_path / "raise.py"
    script.write_text(
        "import atexit, os, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    atexit.register(time.sleep, 30)  # a slow teardown after the traceback\n"
        "else:\n"
        "    time.sleep(1.0)\n"
        "raise ValueError('same error on every rank')\n"
    )
    cfg = LaunchConfig(str(script), worker_num=2, local_worker_num=2, log_dir=str(tmp_path))
    job = NodeAssignment("run", 0, 1, 0, 2, 2, "127.0.0.1", 29500)
    sup = Supervisor(SchedulerLog.open(str(tmp_path), truncate=True))
    sup.start(cfg, job, dict(os.environ))
    try:
        assert [w.rank for w in sup.poll(10.0)] == [0]
    finally:
        sup.stop(grace=5.0)
    exits = sup.exits()
    assert [e.stopped for e in exits] == [False, False]
    text = format_failure_report(worker_root_cause(exits[0], 0, "h"), exits, 0, "s.log")
    assert "ranks 0, 1 failed with the same error:" in text
    assert "stopped by the launcher" not in text


@pytest.mark.multiprocess
def test_a_closed_stdout_does_not_change_the_exit_code(tmp_path: Path) -> None:
    """``shardwise run --join True ok.py | head -0``: the success summary met a closed pipe, the
    launcher exited 1 with a BrokenPipeError and scheduler.log had no ``job end`` line."""
    import subprocess
    import sys

    from shardwise.testing import clean_env, free_port

    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    cmd = [
        sys.executable, "-m", "shardwise", "run", "--worker_num", "1", "--local_worker_num", "1",
        "--master_port", str(free_port()), "--log_dir", str(tmp_path / "logs"), "--join", "True",
        str(script),
    ]  # fmt: skip
    read, write = os.pipe()
    os.close(read)  # (what `| head -0` leaves)
    try:
        proc = subprocess.run(
            cmd, stdout=write, stderr=subprocess.PIPE, env=clean_env(), text=True, timeout=60
        )
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "scheduler.log").read_text()
    assert "job end: launcher exits with code 0" in log, log


def test_a_native_crash_shows_its_python_stacks(tmp_path: Path) -> None:
    """A rank killed by SIGSEGV: faulthandler's dump (several threads, past the last 10 lines)
    is shown from its "Fatal Python error" line, without the list of extension modules."""
    threads = "".join(
        f"\nThread 0x{t:016x} (most recent call first):\n"
        + "".join(f'  File "/job/loader.py", line {i} in worker\n' for i in range(4))
        for t in range(3)
    )
    dump = (
        "Fatal Python error: Segmentation fault\n\n"
        "Current thread 0x00007fdb417e4b80 (most recent call first):\n"
        '  File "/job/train.py", line 5 in crash\n'
        '  File "/job/train.py", line 7 in <module>\n' + threads + "\n"
        "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)"
    )
    e = _exit(tmp_path, 1, -11, "step 1\n" + dump, 1.0)
    lines, is_tb = log_excerpt(e.log_path)
    assert not is_tb and lines[0] == "Fatal Python error: Segmentation fault"
    assert lines[2] == '  File "/job/train.py", line 5 in crash'
    assert len(lines) == 19 and not any("Extension modules" in line for line in lines)
    text = format_failure_report(worker_root_cause(e, 0, "h"), [e], 0, "s.log")
    assert "rank 1 failed first with signal SIGSEGV" in text
    assert '    File "/job/train.py", line 7 in <module>' in text.splitlines()


def test_a_crash_in_the_teardown_after_a_traceback_keeps_the_exception(tmp_path: Path) -> None:
    """A rank raised, then aborted in its teardown: the crash dump after the traceback became
    part of it, so the excerpt showed 30 lines of thread stacks and no ValueError."""
    from shardwise.launch._logs import ends_in_traceback

    threads = "".join(
        f"\nThread 0x{t:016x} (most recent call first):\n"
        + "".join(f'  File "/job/loader.py", line {i} in worker\n' for i in range(6))
        for t in range(6)
    )
    dump = (
        "terminate called without an active exception\n"
        "Fatal Python error: Aborted\n" + threads + "\n"
        "Current thread 0x00007fdb417e4b80 (most recent call first):\n"
        "  <no Python frame>\n\n"
        "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)\n"
    )
    e = _exit(tmp_path, 1, -6, "step 1\n" + TB + dump, 1.0)
    lines, is_tb = log_excerpt(e.log_path)
    assert is_tb and lines[: len(TB.splitlines())] == TB.splitlines()
    assert lines[len(TB.splitlines()) :][:2] == [
        "terminate called without an active exception",
        "Fatal Python error: Aborted",
    ]
    assert not any("Extension modules" in line for line in lines)
    assert ends_in_traceback(e.log_path)
    text = format_failure_report(worker_root_cause(e, 0, "h"), [e], 0, "s.log")
    assert "  ValueError: bad shape" in text.splitlines()


def test_a_native_crash_shows_the_crashing_threads_stack_first(tmp_path: Path) -> None:
    """faulthandler prints the other threads first and the crashing ``Current thread`` last:
    with 6 background threads the 30-line excerpt held only idle threads' frames."""
    threads = "".join(
        f"\nThread 0x{t:016x} (most recent call first):\n"
        '  File "/job/loader.py", line 3 in idle\n'
        '  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
        '  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner\n'
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n'
        for t in range(6)
    )
    dump = (
        "Fatal Python error: Segmentation fault\n" + threads + "\n"
        "Current thread 0x00007fdb417e4b80 (most recent call first):\n"
        '  File "/job/train.py", line 5 in crash\n'
        '  File "/job/train.py", line 7 in <module>\n\n'
        "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)\n"
    )
    e = _exit(tmp_path, 1, -11, "step 1\n" + dump, 1.0)
    lines, is_tb = log_excerpt(e.log_path)
    assert not is_tb and len(lines) <= 30
    assert lines[:4] == [
        "Fatal Python error: Segmentation fault",
        "Current thread 0x00007fdb417e4b80 (most recent call first):",
        '  File "/job/train.py", line 5 in crash',
        '  File "/job/train.py", line 7 in <module>',
    ]
    assert lines[4].startswith("Thread 0x") and lines[-1] == (
        "  ... (1 other thread's stack left out)"
    )


@pytest.mark.multiprocess
def test_a_failing_rank_is_told_from_a_stopped_one_by_what_it_says(tmp_path: Path) -> None:
    """Whether a rank had failed on its own when the launcher stopped it was guessed from its
    log: rank 1 (a handled, printed traceback, then ``epoch: 3``, then still working) was
    reported as failed, rank 2 (raised a two-line message, still tearing down) as stopped;
    rank 3 (its own excepthook installed after init()'s) was not marked failing at all."""
    from shardwise.testing import run_job

    script = tmp_path / "four.py"
    script.write_text(
        "import atexit, os, sys, time, traceback\n"
        "from shardwise import communication as comm\n"
        "if os.environ['RANK'] == '3':  # (runs after init()'s exit handler: registered first)\n"
        "    atexit.register(time.sleep, 60)\n"
        "comm.init('gloo')\n"
        "rank = comm.get_rank()\n"
        "if rank == 3:  # its own excepthook, installed after init()'s\n"
        "    sys.excepthook = lambda *e: traceback.print_exception(*e)\n"
        "    raise LookupError('own hook')\n"
        "if rank == 1:\n"
        "    try:\n"
        "        raise KeyError('handled')\n"
        "    except KeyError:\n"
        "        traceback.print_exc()\n"
        "    print('epoch: 3', flush=True)\n"
        "    time.sleep(60)\n"
        "if rank == 2:\n"
        "    atexit.register(time.sleep, 60)  # a slow teardown after the traceback\n"
        "    raise ValueError('bad config:\\nsecond line of the message')\n"
        "time.sleep(1.0)\n"
        "raise RuntimeError('rank 0 fails')\n"
    )
    res = run_job(script, 4, tmp_path / "logs", timeout=60, env={"SHARDWISE_STOP_GRACE": "3"})
    assert res.returncode == 1, res.output
    assert "stopped by the launcher: rank 1 " in res.output, res.output
    assert "rank 2 also failed" in res.output, res.output
    assert "LookupError: own hook" in res.output, res.output  # (rank 3: failed, not stopped)
    assert "  second line of the message" in res.output.splitlines(), res.output


def test_only_an_uncaught_traceback_at_the_end_of_a_log_counts(tmp_path: Path) -> None:
    """The log-text fallback (a worker that never called init()): a handled traceback followed
    by ``epoch: 3`` / ``loss: 0.3`` / ``WARNING: ...``, or a thread's traceback, counted as
    the worker's failure."""
    from shardwise.launch._logs import ends_in_traceback

    log = tmp_path / "worker_0.log"
    for after in ("epoch: 3\n", "loss: 0.3\n", "WARNING: slow step\n"):
        log.write_text("step 1\n" + TB + after)
        assert not ends_in_traceback(log), after
    log.write_text("step 1\nException in thread Thread-1 (load):\n" + TB)
    assert not ends_in_traceback(log)
    log.write_text("step 1\n" + TB + "\n")
    assert ends_in_traceback(log)
    log.write_text("step 1\n" + TB + "Fatal Python error: Aborted\n\nThread 0x0 (most recent ")
    assert ends_in_traceback(log)


def test_a_rank_that_had_exited_with_0_before_the_stop_is_not_said_to_have_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that had exited with code 0 (its exit not collected yet) when the launcher
    stopped the others was logged as 'had failed on its own before it was stopped'."""
    import subprocess
    import time

    from shardwise.launch.config import LaunchConfig, NodeAssignment
    from shardwise.launch.schedlog import SchedulerLog
    from shardwise.launch.supervisor import Supervisor, has_exited

    class _LateWait(subprocess.Popen):  # type: ignore[type-arg]
        def wait(self, timeout: float | None = None) -> int:
            time.sleep(1.5)  # (the launcher collects its exit after stop() looked at it)
            return super().wait(timeout)

    monkeypatch.setattr(subprocess, "Popen", _LateWait)
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    cfg = LaunchConfig(str(script), worker_num=1, local_worker_num=1, log_dir=str(tmp_path))
    sup = Supervisor(SchedulerLog.open(str(tmp_path), truncate=True))
    sup.start(cfg, NodeAssignment("run", 0, 1, 0, 1, 1, "127.0.0.1", 29500), dict(os.environ))
    deadline = time.monotonic() + 20.0
    while not has_exited(sup.workers[0].pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.stop(grace=3.0)
    log = (tmp_path / "scheduler.log").read_text()
    assert "rank 0 (pid" in log and "had exited before it was stopped (exit code 0)" in log, log
    assert [(e.returncode, e.failed, e.stopped) for e in sup.exits()] == [(0, False, False)]


def test_a_worker_that_cannot_start_stops_the_started_ones_at_once(tmp_path: Path) -> None:
    """worker_1.log cannot be opened after rank 0 started: rank 0 used to be waited for
    without a watcher (5 s, then a false "still running after 5 s: SIGKILL"), and was missing
    from the report."""
    import time

    from shardwise.launch.config import LaunchConfig, NodeAssignment
    from shardwise.launch.schedlog import SchedulerLog
    from shardwise.launch.supervisor import Supervisor

    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(30)\n")
    (tmp_path / "worker_1.log").mkdir()
    cfg = LaunchConfig(str(script), worker_num=2, local_worker_num=2, log_dir=str(tmp_path))
    job = NodeAssignment("run", 0, 1, 0, 2, 2, "127.0.0.1", 29500)
    log = SchedulerLog.open(str(tmp_path), truncate=True)
    sup = Supervisor(log)
    began = time.monotonic()
    with pytest.raises(IsADirectoryError):
        sup.start(cfg, job, dict(os.environ))
    assert time.monotonic() - began < 4.0
    assert [(e.rank, e.stopped) for e in sup.exits()] == [(0, True)]
    log.close()
    scheduler = (tmp_path / "scheduler.log").read_text()
    assert "stopped by the launcher (signal SIGTERM)" in scheduler
    assert "still running" not in scheduler
