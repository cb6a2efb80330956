"""Root-cause reporting: traceback extraction from worker logs, collapsing identical tracebacks,
and the order of the failure report (root cause first, then other failures, stopped ranks, logs).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardwise.launch._logs import describe_returncode, extract_traceback, log_excerpt
from shardwise.launch.report import (
    RootCause,
    WorkerExit,
    first_cause,
    format_failure_report,
    format_ranks,
    format_success_summary,
    group_failures,
    worker_root_cause,
)

TB = """\
Traceback (most recent call last):
  File "/job/train.py", line 9, in <module>
    main()
  File "/job/train.py", line 5, in main
    raise ValueError("bad shape")
ValueError: bad shape
"""


def _exit(
    tmp: Path, rank: int, code: int, text: str, ended: float, stopped: bool = False
) -> WorkerExit:
    log = tmp / f"worker_{rank}.log"
    log.write_text(text)
    return WorkerExit(rank, rank, 1000 + rank, code, ended, stopped, str(log))


def test_extract_traceback_takes_the_last_one_to_the_end() -> None:
    text = (
        "step 1\nTraceback (most recent call last):\n  old\nKeyError: 1\nretrying\n" + TB + "\n\n"
    )
    assert extract_traceback(text) == TB.splitlines()
    assert extract_traceback("no error here\n") == []


def test_extract_traceback_keeps_chained_exceptions_final_part() -> None:
    chained = TB + "\nDuring handling of the above exception, another exception occurred:\n\n" + TB
    assert extract_traceback(chained) == TB.splitlines()


def test_extract_traceback_leaves_out_position_markers() -> None:
    """Python 3.11's ``^^^^`` / ``~~~~`` lines under each call filled the 30-line excerpt (a
    gloo timeout lost the user's own frame); a line of text with a caret in it stays."""
    marked = TB.replace("    main()\n", "    main()\n    ^^^^^^\n").replace(
        '    raise ValueError("bad shape")\n',
        '    raise ValueError("bad shape")\n    ~~~~~^^^^^^^^^^^^^^^^^^^^^^^\n',
    )
    assert marked.count("^") > 20
    assert extract_traceback(marked) == TB.splitlines()
    assert extract_traceback("Traceback (most recent call last):\nE: x ^ y\n")[-1] == "E: x ^ y"


def test_extract_traceback_is_capped_keeping_the_end() -> None:
    frames = "".join(f'  File "f.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(40))
    text = "Traceback (most recent call last):\n" + frames + "RecursionError: deep\n"
    tb = extract_traceback(text, max_lines=30)
    assert len(tb) in (29, 30)  # (whole frames of 2 lines each)
    assert tb[0].startswith("Traceback") and tb[1:3] == ['  File "f.py", line 0, in f0', "    f1()"]
    assert tb[3] == "  ... (54 lines left out)"  # (the outermost frame stays, then the last ones)
    assert tb[-3:] == ['  File "f.py", line 39, in f39', "    f40()", "RecursionError: deep"]


def test_the_cap_leaves_library_frames_out_before_the_users(tmp_path: Path) -> None:
    """quick_start.py failing in the planner: the 30-line cap kept only shardwise's frames
    (23 lines left out, the script's own lines among them)."""
    import shardwise

    package = Path(shardwise.__file__).parent
    torch_file = "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py"
    user = [('  File "/job/train.py", line 40, in <module>', "    main()"),
            ('  File "/job/train.py", line 31, in main', "    model.train(2, data)")]  # fmt: skip
    library = [(f'  File "{package}/planner/_gc.py", line {i}, in paused', "    fn()")
               for i in range(20)]  # fmt: skip
    frames = [user[0], (f'  File "{torch_file}", line 1, in _call', "    f()"), *library[:10],
              user[1], *library[10:]]  # fmt: skip
    text = "Traceback (most recent call last):\n" + "".join(f"{a}\n{b}\n" for a, b in frames)
    tb = extract_traceback(text + "ValueError: bad strategy\n", max_lines=30)
    assert len(tb) <= 30 and tb[-1] == "ValueError: bad strategy"
    for a, b in user:
        assert tb[tb.index(a) + 1] == b
    assert tb.index(user[0][0]) < tb.index(user[1][0])
    assert tb[-3] == f'  File "{package}/planner/_gc.py", line 19, in paused'  # (the innermost)
    assert not any(torch_file in line for line in tb)  # (farthest from the exception: first out)


def test_log_excerpt_falls_back_to_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "worker_0.log"
    log.write_text("".join(f"line {i}\n" for i in range(20)))
    lines, is_tb = log_excerpt(log)
    assert not is_tb and lines == [f"line {i}" for i in range(10, 20)]
    log.write_text("")
    assert log_excerpt(log) == (["(worker_0.log is empty)"], False)


def test_identical_tracebacks_collapse_in_failure_order(tmp_path: Path) -> None:
    exits = [
        _exit(tmp_path, 0, -15, "", 5.0, stopped=True),
        _exit(tmp_path, 3, 1, TB, 2.0),
        _exit(tmp_path, 1, 1, TB, 1.0),
        _exit(tmp_path, 2, 1, TB.replace("bad shape", "other"), 3.0),
    ]
    groups = group_failures(exits)
    assert [g.ranks for g in groups] == [[1, 3], [2]]
    assert groups[0].is_traceback and groups[0].lines[-1] == "ValueError: bad shape"


def test_failure_report_puts_the_root_cause_first(tmp_path: Path) -> None:
    exits = [
        _exit(tmp_path, 0, -15, "working\n", 5.0, stopped=True),
        _exit(tmp_path, 1, 1, TB, 1.0),
        _exit(tmp_path, 2, -9, "", 5.0, stopped=True),
        _exit(tmp_path, 3, 1, TB, 2.0),
    ]
    root = worker_root_cause(exits[1], 0, "host")
    text = format_failure_report(root, exits, 0, "/logs/scheduler.log")
    lines = text.splitlines()
    assert lines[0] == "shardwise run: job failed: rank 1 failed first with exit code 1 (pid 1001)"
    assert lines[1] == "ranks 1, 3 failed with the same error:"
    assert lines[2:8] == ["  " + line for line in TB.splitlines()]
    assert lines[8] == "stopped by the launcher: ranks 0, 2 (ended by SIGKILL, SIGTERM)"
    assert lines[9] == f"logs: {tmp_path}/worker_1.log, /logs/scheduler.log"


PEER_GONE = """\
Traceback (most recent call last):
  File "/job/train.py", line 7, in <module>
    sw.ops.AllReduce()(x)
RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5321
"""


def test_a_rank_that_lost_its_peer_is_not_the_root_cause(tmp_path: Path) -> None:
    """Rank 1 ended with sys.exit(3) and closed its connections; rank 0, waiting in a
    collective, failed a moment before rank 1's exit was seen. Rank 1 is the root cause, and
    rank 2, which the launcher stopped, is listed with the code it was stopped with."""
    exits = [
        _exit(tmp_path, 0, 1, "step 1\n" + PEER_GONE, 10.00),
        _exit(tmp_path, 1, 3, "step 1\nleaving early\n", 10.02),
        _exit(tmp_path, 2, 1, "", 12.0, stopped=True),
    ]
    root = first_cause(exits[:2])
    assert root.rank == 1
    assert first_cause([exits[0]]).rank == 0  # (alone: still the first)
    lines = format_failure_report(worker_root_cause(root, 0, "h"), exits, 0, "s.log").splitlines()
    assert lines[0] == "shardwise run: job failed: rank 1 failed first with exit code 3 (pid 1001)"
    assert lines[1:4] == [
        "no traceback in worker_1.log; its last lines:", "  step 1", "  leaving early"
    ]  # fmt: skip
    assert lines[4] == "rank 0 also failed with exit code 1 (pid 1000):"
    assert "stopped by the launcher: rank 2 (ended by exit code 1)" in lines


def test_failure_report_signal_and_other_failures(tmp_path: Path) -> None:
    exits = [
        _exit(tmp_path, 0, -9, "loading\n", 1.0),
        _exit(tmp_path, 1, 2, TB, 2.0),
    ]
    text = format_failure_report(worker_root_cause(exits[0], 0, "h"), exits, 0, "s.log")
    assert text.splitlines()[0].endswith("rank 0 failed first with signal SIGKILL (pid 1000)")
    assert "no traceback in worker_0.log; its last lines:\n  loading" in text
    assert "rank 1 also failed with exit code 2 (pid 1001):" in text
    assert text.index("SIGKILL") < text.index("ValueError")


def test_failure_report_from_another_node(tmp_path: Path) -> None:
    root = RootCause.from_json(
        RootCause(
            "rank 5 failed first with exit code 1 (pid 7)",
            node_rank=1,
            host="nodeB",
            rank=5,
            lines=tuple(TB.splitlines()),
            log="/b/worker_5.log",
        ).to_json()
    )
    exits = [_exit(tmp_path, 0, -15, "", 1.0, stopped=True)]
    text = format_failure_report(root, exits, 0, "/a/scheduler.log")
    lines = text.splitlines()
    assert lines[0] == (
        "shardwise run: job failed on node 1 (nodeB): rank 5 failed first with exit code 1 (pid 7)"
    )
    assert lines[-3] == "  ValueError: bad shape"
    assert lines[-2] == "stopped by the launcher: rank 0 (ended by SIGTERM)"
    assert lines[-1] == "logs: /b/worker_5.log (on nodeB), /a/scheduler.log"


def test_root_cause_json_survives_garbage() -> None:
    root = RootCause.from_json(b"not json")
    assert "another launcher reported a failure" in root.reason


def test_small_formatters() -> None:
    assert describe_returncode(1) == "exit code 1"
    assert describe_returncode(-9) == "signal SIGKILL"
    assert describe_returncode(-15) == "signal SIGTERM"
    assert format_ranks([3, 0, 1, 2]) == "0-3"
    assert format_ranks([1, 3]) == "1, 3"
    assert format_ranks([0, 1]) == "0, 1"
    summary = format_success_summary([], 1.25, "/logs")
    assert "job finished" in summary and "/logs/scheduler.log" in summary


def test_success_summary_of_one_rank_says_rank(tmp_path: Path) -> None:
    """A one-worker job's summary read "ranks 0 exited with code 0"."""
    one = format_success_summary([_exit(tmp_path, 0, 0, "", 1.0)], 1.0, "/logs")
    assert one.startswith("shardwise run: job finished: rank 0 exited with code 0 in 1.0 s")
    two = [_exit(tmp_path, r, 0, "", 1.0) for r in range(2)]
    assert "job finished: ranks 0, 1 exited with code 0" in format_success_summary(two, 1.0, "/l")


def test_extract_traceback_strips_torch_rank_prefixes() -> None:
    from shardwise.launch._logs import extract_traceback

    text = (
        "[rank2]: Traceback (most recent call last):\n"
        '[rank2]:   File "/tmp/fail.py", line 6, in <module>\n'
        "[rank2]: RuntimeError: boom on rank 2\n"
    )
    assert extract_traceback(text) == [
        "Traceback (most recent call last):",
        '  File "/tmp/fail.py", line 6, in <module>',
        "RuntimeError: boom on rank 2",
    ]


def test_a_rank_that_left_with_code_0_is_named(tmp_path: Path) -> None:
    """Rank 1 exited with code 0 before joining; rank 0 then timed out waiting for it in
    init(): the report names rank 1's early exit (it listed rank 0 alone)."""
    exits = [
        _exit(tmp_path, 0, 1, TB, 10.0),
        _exit(tmp_path, 1, 0, "rank 1: not joining\n", 1.0),
    ]
    text = format_failure_report(worker_root_cause(exits[0], 0, "h"), exits, 0, "s.log")
    assert text.splitlines()[-2] == (
        "exited with code 0: rank 1 (a rank that leaves early leaves the others waiting in "
        "init() or at their next collective)"
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
