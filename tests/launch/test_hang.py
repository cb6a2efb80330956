"""`launch.hang` on trace files written by `communication._trace` (no processes): which ranks
never arrived at the failed rank's collective, and how the report puts them first."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.communication import _trace
from shardwise.communication._init import Group
from shardwise.launch.hang import Trace, find_stragglers, read_trace
from shardwise.launch.report import RootCause, WorkerExit, format_failure_report

WORLD = Group("world_group", (0, 1, 2, 3), None)
PAIR = Group("pair", (2, 3), None)


def write(path: Path, calls: list[tuple[str, Group, bool]]) -> None:
    """A trace of `calls`: (kind, group, finished)."""
    assert _trace.open_trace(str(path))
    try:
        for kind, group, finished in calls:
            token = _trace.enter(kind, group)
            if finished:
                _trace.leave(token)
    finally:
        _trace.close_trace()


def traces(tmp_path: Path, calls: dict[int, list[tuple[str, Group, bool]]]) -> dict[int, Trace]:
    for rank, rank_calls in calls.items():
        write(tmp_path / f"{rank}.comm", rank_calls)
    out = {rank: read_trace(tmp_path / f"{rank}.comm") for rank in calls}
    return {rank: t for rank, t in out.items() if t is not None}


def test_a_rank_behind_the_others_never_arrived(tmp_path: Path) -> None:
    done = ("AllReduce", WORLD, True)
    found = traces(
        tmp_path,
        {
            0: [done, ("AllReduce", WORLD, False)],
            1: [done],
            2: [done, ("AllReduce", PAIR, True), ("AllReduce", WORLD, False)],
            3: [done, ("AllReduce", PAIR, True), ("AllReduce", WORLD, False)],
        },
    )
    t2 = found[2]
    assert t2 is not None and t2.last == "world_group"
    assert t2.groups["pair"].ranks == (2, 3) and t2.groups["pair"].finished == 1
    result = find_stragglers(2, found)
    assert result is not None
    assert (result.group, result.kind, result.seq) == ("world_group", "AllReduce", 2)
    assert result.missing == (1,) and result.waiting == (0, 2, 3)
    assert result.target() == "AllReduce #2 of group world_group (ranks 0-3)"


def test_a_rank_in_another_collective_never_arrived(tmp_path: Path) -> None:
    found = traces(
        tmp_path,
        {
            0: [("AllReduce", WORLD, False)],
            1: [("AllGather", WORLD, False)],
            2: [("AllReduce", WORLD, False)],
            3: [("AllReduce", WORLD, False)],
        },
    )
    for failed in (0, 1):  # whoever timed out first, the odd one out is named
        result = find_stragglers(failed, found)
        assert result is not None and result.missing == (1,) and result.kind == "AllReduce"


def test_nothing_to_explain(tmp_path: Path) -> None:
    everyone = {r: [("AllReduce", WORLD, r != 0)] for r in range(4)}
    found = traces(tmp_path, everyone)
    assert find_stragglers(0, found) is None  # all arrived: a plain failure
    behind = traces(tmp_path, {0: [("AllReduce", WORLD, False)], 1: []})
    entered = behind[0].groups["world_group"].entered_at
    assert find_stragglers(0, behind, entered + 5.0, min_wait=1.0) is not None
    # failed 0.1 s after it entered: an error of the collective, rank 1 was on its way
    assert find_stragglers(0, behind, entered + 0.1, min_wait=1.0) is None
    assert find_stragglers(1, found) is None  # not inside a collective
    assert read_trace(tmp_path / "missing.comm") is None
    (tmp_path / "junk.comm").write_bytes(b"x" * _trace.SIZE)
    assert read_trace(tmp_path / "junk.comm") is None


def test_the_report_puts_the_stuck_ranks_first(tmp_path: Path) -> None:
    log = tmp_path / "worker_2.log"
    log.write_text("Traceback (most recent call last):\n  x\nRuntimeError: Timed out\n")
    root = RootCause(
        "rank 1 never arrived at AllReduce #2", 0, "h", 2, ("RuntimeError: Timed out",), str(log),
        stuck=("rank 1 (pid 7, still running): ...", "  its Python stack:"),
    )  # fmt: skip
    assert RootCause.from_json(root.to_json()) == root
    exits = [WorkerExit(2, 2, 9, 1, 1.0, False, str(log))]
    text = format_failure_report(root, exits, 0, "s.log").splitlines()
    assert text[:4] == [
        "shardwise run: job failed: rank 1 never arrived at AllReduce #2",
        "rank 1 (pid 7, still running): ...",
        "  its Python stack:",
        "rank 2 failed first with exit code 1 (pid 9):",
    ]
    assert text[4:7] == [
        "  Traceback (most recent call last):",
        "    x",
        "  RuntimeError: Timed out",
    ]
    # the other waiting ranks timed out beside it (not stopped): the first is still named
    for r in (0, 3):
        (tmp_path / f"worker_{r}.log").write_text(log.read_text())
    exits += [WorkerExit(r, r, 10 + r, 1, 1.5, False, str(tmp_path / f"worker_{r}.log"))
              for r in (0, 3)]  # fmt: skip
    text = format_failure_report(root, exits, 0, "s.log").splitlines()
    assert text[3:5] == [
        "rank 2 failed first with exit code 1 (pid 9):",
        "ranks 2, 0, 3 failed with the same error:",
    ]


def test_nccl_style_traces_and_the_collective_entered_last(tmp_path: Path) -> None:
    """NCCL returns once a collective is queued, so a waiting rank shows nothing unfinished:
    the collective it entered last is taken, unless the failed rank is the one behind (then its
    own error is the cause). A prefetch still open on another group does not hide the
    collective entered after it."""
    done = ("AllReduce", WORLD, True)
    queued = traces(tmp_path, {0: [done, done], 1: [done], 2: [done, done], 3: [done, done]})
    result = find_stragglers(0, queued)
    assert result is not None and result.missing == (1,) and result.seq == 2
    assert find_stragglers(1, queued) is None  # rank 1 raised before its second AllReduce
    prefetch = ("AllGather", PAIR, False)
    found = traces(
        tmp_path,
        {
            2: [prefetch, ("AllReduce", WORLD, False)],
            3: [prefetch, ("AllReduce", WORLD, False)],
            0: [("AllReduce", WORLD, False)],
            1: [],
        },
    )
    result = find_stragglers(2, found)
    assert result is not None and result.group == "world_group" and result.missing == (1,)


def test_a_rank_that_exits_while_asked_for_its_stack_is_not_still_running(
    tmp_path: Path,
) -> None:
    """Rank 0, in another collective, timed out too and exited while the launcher waited for
    its stack: the report said "still running ... did not write its stack"; and a rank that the
    launcher's SIGUSR1 ended after its own traceback was reported as failed with SIGUSR1."""
    import signal
    import subprocess
    import sys
    import time

    from shardwise.launch.hang import explain
    from shardwise.launch.schedlog import SchedulerLog
    from shardwise.launch.supervisor import Supervisor, Worker

    world = Group("world_group", (0, 1), None)
    write(tmp_path / "worker_0.comm", [("AllGather", world, False)])
    write(tmp_path / "worker_1.comm", [("AllReduce", world, False)])
    logs = [tmp_path / f"worker_{r}.log" for r in (0, 1)]
    for r, log in enumerate(logs):
        log.write_text(f"Traceback (most recent call last):\n  x\nRuntimeError: Timed out {r}\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited, its exit not collected by the launcher yet
    workers = [Worker(r, r, gone, logs[r], time.monotonic()) for r in (0, 1)]
    workers[1].returncode = 1
    failed = WorkerExit(1, 1, 9, 1, time.time() + 5.0, False, str(logs[1]))
    root = explain(RootCause("rank 1 failed", 0, "h", 1, (), str(logs[1])), failed, workers)
    assert root.stuck[0].startswith("rank 0 (pid ") and "already exited" in root.stuck[0]
    assert not any("did not write its stack" in line for line in root.stuck)

    assert workers[0].stack_requested is False  # (its trace was not written by its pid)
    workers[0].stack_requested, workers[0].returncode = True, -signal.SIGUSR1
    sup = Supervisor(SchedulerLog.open(tmp_path, truncate=True))
    sup.workers = workers
    exit0 = sup.exits()[0]
    assert not exit0.stopped and exit0.ended_by_launcher
    text = format_failure_report(root, [failed, exit0], 0, "s.log")
    assert "SIGUSR1" in text and "failed with signal SIGUSR1" not in text
    assert f"rank 0 also failed (pid {gone.pid}; the launcher's SIGUSR1 ended its teardown):" in (
        text.splitlines()
    )


_LIB = "/venv/lib/python3.11/site-packages"
IN_INIT = (
    'Traceback (most recent call last):\n  File "/job/t.py", line 8, in <module>\n'
    f'    comm.init()\n  File "{_LIB}/shardwise/communication/_init.py", line 117, in init\n'
    "    dist.init_process_group(\n"
    + "".join(
        f'  File "{_LIB}/torch/distributed/{f}.py", line {n}, in {fn}\n    {src}\n'
        for f, n, fn, src in (
            ("c10d_logger", 83, "wrapper", "return func(*args, **kwargs)"),
            ("c10d_logger", 97, "wrapper", "func_return = func(*args, **kwargs)"),
            ("distributed_c10d", 1899, "init_process_group", "default_pg, _ = _new_pg("),
            ("distributed_c10d", 2169, "_new_pg", "backend_class = ProcessGroupGloo("),
        )
    )
    + "torch.distributed.DistStoreError: wait timeout after 8000ms, keys: /job/x/0//cpu//0/1\n"
)
"""Rank 0's log when it timed out in shardwise's init() waiting for rank 1."""


def _explained(tmp_path: Path, log0: str) -> tuple[RootCause, int]:
    """`explain` of rank 0 failing with `log0` while rank 1 still runs (no trace files)."""
    import subprocess
    import sys
    import time

    from shardwise.launch.hang import explain
    from shardwise.launch.supervisor import Worker

    logs = [tmp_path / f"worker_{r}.log" for r in (0, 1)]
    logs[0].write_text(log0)
    logs[1].write_text("")
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        done.wait()
        workers = [Worker(r, r, p, logs[r], time.monotonic()) for r, p in enumerate([done, stuck])]
        workers[0].returncode = 1
        failed = WorkerExit(0, 0, done.pid, 1, time.time(), False, str(logs[0]))
        root = explain(
            RootCause("rank 0 failed first", 0, "h", 0, (), str(logs[0])), failed, workers
        )
    finally:
        stuck.kill()
        stuck.wait()
    return root, stuck.pid


DEEP = IN_INIT.replace(
    '  File "/job/t.py", line 8, in <module>\n    comm.init()\n',
    "".join(f'  File "/job/t.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(12))
    + '  File "/job/t.py", line 40, in f12\n    comm.init()\n',
)
"""`IN_INIT` called 13 frames deep: the report's excerpt (30 lines) drops init's frame."""


@pytest.mark.parametrize("log0", [IN_INIT, DEEP], ids=["shallow", "deep"])
def test_a_rank_that_never_reached_init_is_named(tmp_path: Path, log0: str) -> None:
    """Rank 1 is stuck in the script before init(); rank 0 times out in init() waiting for it
    (no trace file yet on either). The report blamed rank 0's DistStoreError on a store key and
    listed rank 1 only as stopped by the launcher; with init() called deep in the script the
    check read the trimmed excerpt, init's frame gone (a review found it)."""
    root, pid = _explained(tmp_path, log0)
    assert root.reason == (
        "rank 1 never finished init() (still running: in the script before it, or stuck in "
        "it); rank 0 failed first waiting for it in init()"
    )
    assert root.stuck[0].startswith(f"rank 1 (pid {pid}, still running): had not finished init()")


@pytest.mark.parametrize(
    "log0",
    [
        IN_INIT.replace(f"{_LIB}/shardwise/communication/_init.py", "/job/t.py"),  # (torch's)
        'Traceback (most recent call last):\n  File "/job/t.py", line 3, in <module>\n'
        "    wait(timeout=3)\nKeyError: 'x'\n",  # (a source line naming a timeout)
        'Traceback (most recent call last):\n  File "/job/t.py", line 3, in <module>\n'
        "    raise TimeoutError('own')\nTimeoutError: own\n",  # (before init())
    ],
    ids=["plain torch init", "keyerror", "own timeout"],
)
def test_other_timeouts_are_not_blamed_on_a_rank_before_init(tmp_path: Path, log0: str) -> None:
    """Only a timeout inside shardwise's init() names the ranks without a trace: a review
    found a plain torch job's timeout, a user's own TimeoutError and a source line holding
    ``timeout=3`` all reported as "rank 1 never reached init()"."""
    root, _ = _explained(tmp_path, log0)
    assert root.reason == "rank 0 failed first" and root.stuck == ()


@pytest.mark.multiprocess
def test_a_native_crash_under_init_leaves_its_python_stack(tmp_path: Path) -> None:
    """A worker killed by SIGSEGV left no Python stack in its log: `init()` enables
    ``faulthandler``, and the report shows the crashing thread's stack."""
    from shardwise.testing import run_job

    script = tmp_path / "crash.py"
    script.write_text(
        "import faulthandler\n"
        "from shardwise import communication as comm\n"
        "comm.init('gloo')\n"
        "def crash() -> None:\n"
        "    if comm.get_rank() == 1:\n"
        "        faulthandler._sigsegv()\n"
        "crash()\n"
    )
    res = run_job(script, 2, tmp_path / "logs", timeout=60)
    lines = res.output.splitlines()
    assert res.returncode == 1 and "rank 1 failed first with signal SIGSEGV" in lines[0], lines
    assert f'    File "{script}", line 6 in crash' in lines, lines
    assert f'    File "{script}", line 7 in <module>' in lines, lines
