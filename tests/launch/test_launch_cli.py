"""`shardwise run` / `swrun` command line: msrun options, both spellings, booleans, pass-through
of the script's arguments, and clear usage errors (exit code 2)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from shardwise.launch import cli
from shardwise.launch.cli import parse_bool, parse_run_args, split_argv


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_defaults_match_msrun(script: str) -> None:
    cfg = parse_run_args([script])
    assert (cfg.worker_num, cfg.local_worker_num) == (8, 8)
    assert (cfg.master_addr, cfg.master_port, cfg.node_rank) == ("127.0.0.1", 8118, -1)
    assert (cfg.log_dir, cfg.join, cfg.cluster_time_out, cfg.bind_core) == (".", False, 600, False)
    assert cfg.script == script and cfg.script_args == ()


def test_local_worker_num_defaults_to_worker_num(script: str) -> None:
    cfg = parse_run_args(["--worker_num", "4", script])
    assert (cfg.worker_num, cfg.local_worker_num, cfg.single_node) == (4, 4, True)
    assert parse_run_args(["--local_worker_num", "2", script]).worker_num == 8


def test_every_option_in_both_spellings(script: str) -> None:
    underscores = [
        "--worker_num", "8", "--local_worker_num", "4", "--master_addr", "10.0.0.1",
        "--master_port", "9000", "--node_rank", "1", "--log_dir", "out", "--join", "True",
        "--cluster_time_out", "30", "--bind_core", "true", script,
    ]  # fmt: skip
    dashes = [a.replace("_", "-") if a.startswith("--") else a for a in underscores]
    equals = [f"{a}={b}" for a, b in zip(underscores[:-1:2], underscores[1:-1:2], strict=True)]
    for argv in (underscores, dashes, [*equals, script]):
        cfg = parse_run_args(argv)
        assert (cfg.worker_num, cfg.local_worker_num, cfg.node_rank) == (8, 4, 1)
        assert (cfg.master_addr, cfg.master_port, cfg.log_dir) == ("10.0.0.1", 9000, "out")
        assert cfg.join and cfg.bind_core and cfg.cluster_time_out == 30


def test_script_arguments_pass_through_untouched(script: str) -> None:
    args = ["--worker_num", "99", "--lr=0.1", "-v", "--", "positional", "--join"]
    cfg = parse_run_args(["--worker_num", "2", "--local_worker_num", "2", script, *args])
    assert cfg.worker_num == 2
    assert cfg.script_args == tuple(args)


def test_double_dash_ends_the_options(script: str) -> None:
    cfg = parse_run_args(["--worker_num", "2", "--local_worker_num", "1", "--", script, "-x"])
    assert cfg.script == script and cfg.script_args == ("-x",)


def test_split_argv() -> None:
    assert split_argv(["--join", "True", "a.py", "--join", "False"]) == (
        ["--join", "True"],
        ["a.py", "--join", "False"],
    )
    assert split_argv(["--join=True", "a.py"]) == (["--join=True"], ["a.py"])
    assert split_argv(["--worker_num", "2"]) == (["--worker_num", "2"], [])


@pytest.mark.parametrize(
    ("text", "value"),
    [("True", True), ("true", True), ("1", True), ("False", False), ("false", False), ("0", False)],
)
def test_parse_bool(text: str, value: bool) -> None:
    assert parse_bool(text) is value


@pytest.mark.parametrize("text", ["maybe", "", "2", "Truee"])
def test_parse_bool_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected True/False"):
        parse_bool(text)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worker_num", "4", "--local_worker_num", "8"], "--local_worker_num 8 is more than"),
        (["--worker_num", "0"], "must be at least 1"),
        (["--local_worker_num", "0"], "must be at least 1"),
        (["--worker_num", "four"], "expected an integer"),
        (["--join", "maybe"], "expected True/False (or true/false, yes/no, 1/0)"),
        (["--bind_core", "yes please"], "expected True/False"),
        (["--master_port", "70000"], "at most 65535"),
        (["--cluster_time_out", "0"], "more than 0 seconds"),
        (["--cluster_time_out", "inf"], "--cluster_time_out/--cluster-time-out: must be more"),
        (["--cluster_time_out", "nan"], "more than 0 seconds and at most 2147483.647"),
        (["--cluster_time_out", "3e6"], "more than 0 seconds and at most 2147483.647"),
        (["--master_addr", ""], "--master_addr/--master-addr: expected the host name"),
        (["--master_addr", " "], "expected the host name or IP address of node 0, got ' '"),
        (["--node_rank", "-2"], "at least -1"),
        (["--worker_num", "8", "--local_worker_num", "4", "--node_rank", "5"], "impossible"),
        (["--no_such_option", "1"], "unrecognized arguments"),
        (["--master_p", "29629"], "unrecognized arguments: --master_p"),  # (no abbreviations:
        # argparse took it for --master_port, our split for a flag, 29629 as the script)
    ],
)
def test_usage_errors_exit_2_with_a_reason(
    argv: list[str], message: str, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_run_args([*argv, script])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1  # (one line, as the docs say)
    assert err.endswith("(see shardwise run --help)\n")


@pytest.mark.parametrize(
    ("name", "value", "bound"),
    [
        ("SHARDWISE_NODE_TIMEOUT", "abc", "1 or more"),
        ("SHARDWISE_NODE_TIMEOUT", "0", "1 or more"),  # (every node "lost" at once)
        ("SHARDWISE_NODE_TIMEOUT", "0.4", "1 or more"),  # (less than two heartbeats)
        ("SHARDWISE_COMM_TIMEOUT", "abc", "more than 0"),
        ("SHARDWISE_COMM_TIMEOUT", "-1", "more than 0"),
        ("SHARDWISE_STOP_GRACE", "soon", "0 or more"),
        ("SHARDWISE_STOP_GRACE", "nan", "0 or more"),
        ("SHARDWISE_STOP_GRACE", "-1", "0 or more"),
        ("SHARDWISE_COMM_TIMEOUT", "1e15", "more than 0 and at most 2147483.647"),
        ("SHARDWISE_NODE_TIMEOUT", "3e6", "1 or more and at most 2147483.647"),
        ("SHARDWISE_STOP_GRACE", "inf", "0 or more and at most 2147483.647"),
    ],
)
def test_a_bad_duration_in_the_environment_is_a_usage_error(
    name: str,
    value: str,
    bound: str,
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bad value used to crash every launch with a bare ValueError and exit code 1
    (``SHARDWISE_NODE_TIMEOUT``), fail a healthy job ("node 0 lost", for 0), fail every
    worker (``SHARDWISE_COMM_TIMEOUT``; 1e15 s too: an OverflowError in each worker's
    timedelta), or be ignored (``SHARDWISE_STOP_GRACE``; -1 was taken as 0). A job of two
    nodes, where every one of them is read."""
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        parse_run_args(["--worker_num", "2", "--local_worker_num", "1", script])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"environment variable {name}={value!r}: expected a number of seconds, {bound}" in err
    assert "unset it for the default" in err and err.count("\n") == 1


def test_good_durations_in_the_environment_are_taken(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardwise.launch.liveness import node_timeout
    from shardwise.launch.supervisor import stop_grace

    monkeypatch.setenv("SHARDWISE_NODE_TIMEOUT", "1.5")
    monkeypatch.setenv("SHARDWISE_STOP_GRACE", "0")
    monkeypatch.setenv("SHARDWISE_COMM_TIMEOUT", "")  # (empty: the default)
    assert parse_run_args(["--worker_num", "2", script]).worker_num == 2
    assert (node_timeout(), stop_grace()) == (1.5, 0.0)


def test_the_node_timeout_is_not_checked_for_a_job_on_one_node(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``SHARDWISE_NODE_TIMEOUT`` bounds the heartbeats between the launchers of several
    nodes: a job on one node never reads it, and a value below its least (0.5) no longer
    refuses such a job; a job of two nodes still is refused."""
    monkeypatch.setenv("SHARDWISE_NODE_TIMEOUT", "0.5")
    assert parse_run_args(["--worker_num", "2", script]).single_node
    with pytest.raises(SystemExit) as exc:
        parse_run_args(["--worker_num", "2", "--local_worker_num", "1", script])
    assert exc.value.code == 2
    assert "SHARDWISE_NODE_TIMEOUT='0.5'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--sim_level", "1"],
        ["--rank_table_file", "rt.json"],
        ["--tail-worker-log", "0"],
        ["--worker_log_name=w.log"],
    ],
)
def test_an_msrun_option_shardwise_lacks_says_so(
    argv: list[str], script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was argparse's generic "unrecognized arguments" (and ``--sim_level 1 train.py`` ran
    the script "1")."""
    with pytest.raises(SystemExit) as exc:
        parse_run_args([*argv, script, "--x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    option = argv[0].split("=")[0]
    assert f"msrun option {option} is not supported by shardwise run" in err
    assert "--worker_num" in err and "--bind_core" in err and err.count("\n") == 1


def test_join_false_says_worker_for_one_worker() -> None:
    from shardwise.launch.detach import started_text

    one = started_text({"pid": 7, "node_rank": 0, "num_nodes": 2, "ranks": [0]}, Path("log"))
    assert one.startswith("shardwise run: 1 worker started (rank 0, node 0 of 2), supervised")
    two = started_text({"pid": 7, "node_rank": 0, "num_nodes": 1, "ranks": [0, 1]}, Path("log"))
    assert two.startswith("shardwise run: 2 workers started (ranks 0, 1, node 0 of 1)")


def test_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_run_args(["--worker_num", "2", str(tmp_path / "nope.py")])
    assert exc.value.code == 2
    assert "nope.py' does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_run_args(["--worker_num", "2"])
    assert "no script given" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_run_args([str(tmp_path)])
    assert "is not a file" in capsys.readouterr().err


def test_shardwise_help_lists_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "run" in out and "msrun" in out
    assert cli.main([]) == 2


def test_run_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    for name in ["worker_num", "local_worker_num", "master_addr", "master_port", "node_rank"]:
        assert f"--{name}" in out
    for name in ["log_dir", "join", "cluster_time_out", "bind_core"]:
        assert f"--{name}" in out


def test_command_line_round_trips(script: str) -> None:
    """scheduler.log's command line is quoted: script arguments "a b" and "" read as a b and
    nothing."""
    argv = ["--worker_num", "2", "--local_worker_num", "2", "--log_dir", "l sp", script]
    cfg = parse_run_args([*argv, "--a", "1", "a b", ""])
    assert cfg.command_line().endswith(" --a 1 'a b' ''")
    assert parse_run_args(shlex.split(cfg.command_line())) == cfg
