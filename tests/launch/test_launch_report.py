"""Root-cause reporting: traceback extraction from worker logs, collapsing identical tracebacks,
and the order of the failure report (root cause first, then other failures, stopped ranks, logs).
"""

from __future__ import annotations

from pathlib import Path

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


def test_a_traceback_after_a_prompt_without_newline_is_found(tmp_path: Path) -> None:
    """``input("prompt> ")`` with no input: the traceback follows the prompt on its line. The
    report said "no traceback in worker_0.log" and then printed it as the last lines."""
    from shardwise.launch._logs import ends_in_traceback

    text = (
        'prompt> Traceback (most recent call last):\n  File "/job/f.py", line 2, in <module>\n'
        '    x = input("prompt> ")\n        ^^^^^^^^^^^^^^^^^\nEOFError: EOF when reading a line\n'
    )
    e = _exit(tmp_path, 0, 1, text, 1.0)
    lines, is_tb = log_excerpt(e.log_path)
    assert is_tb and lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "EOFError: EOF when reading a line"
    assert ends_in_traceback(e.log_path)
    report = format_failure_report(worker_root_cause(e, 0, "h"), [e], 0, "s.log")
    assert "no traceback" not in report and "  EOFError: EOF when reading a line" in report


def test_a_very_long_last_line_is_shortened(tmp_path: Path) -> None:
    """A 5 MB line without a newline was copied whole (256 KiB read back) into the report."""
    e = _exit(tmp_path, 1, 4, "starting\n" + "x" * 5_000_000 + "END", 1.0)
    lines, _ = log_excerpt(e.log_path)
    assert lines[-1].startswith("x" * 200) and lines[-1].endswith("xxEND")
    assert "characters left out" in lines[-1] and len(lines[-1]) < 500
    report = format_failure_report(worker_root_cause(e, 1, "h"), [e], 0, "s.log")
    assert max(len(line) for line in report.splitlines()) < 520


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


def test_log_lines_from_another_node_say_there_was_no_traceback(tmp_path: Path) -> None:
    # (rank 2 on node 1 exited with code 3 and an empty log: node 0 says it as node 1 does)
    local = worker_root_cause(_exit(tmp_path, 2, 3, "", 1.0), 1, "nodeB")
    remote = RootCause.from_json(local.to_json())
    assert remote == local and not remote.traceback
    lines = format_failure_report(remote, [], 0, "/a/scheduler.log").splitlines()
    assert lines[1:3] == [
        "no traceback in worker_2.log; its last lines:",
        "  (worker_2.log is empty)",
    ], lines


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
