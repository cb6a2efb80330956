"""The command line: ``shardwise run [options] script.py [script args]``, also ``swrun``.

- `main`: the ``shardwise`` command; ``shardwise --help`` lists its subcommands (``run``;
  ``plan``, the dry run of `dry_run.plan_main`).
- `swrun_main`: the ``swrun`` command, the same as ``shardwise run``.
- `parse_run_args`: msrun-compatible options (each spelled ``--worker_num`` or
  ``--worker-num``) to a validated `LaunchConfig`; user errors exit with code 2 and a
  one-line reason (argparse's ``error``), a bad ``SHARDWISE_*`` duration in the environment
  (read by the functions that use them; ``SHARDWISE_NODE_TIMEOUT`` for a job of several
  nodes only) too.
- `split_argv`: the launcher's options end at the script; everything after it, ``--x``
  options included, goes to the script untouched.
- `parse_bool`: msrun's booleans, ``True``/``False``/``true``/``false``/``1``/``0``.

The job itself is `detach.launch` (``--join``) and `job.run_job`; see docs/launcher.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from shardwise._envvars import MAX_SECONDS, comm_timeout_s
from shardwise.launch.config import LaunchConfig
from shardwise.launch.errors import EXIT_USAGE
from shardwise.launch.liveness import node_timeout
from shardwise.launch.supervisor import stop_grace

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})

EPILOG = """\
examples:
  shardwise run --worker_num 8 --local_worker_num 8 --log_dir log_output --join True train.py
  # two machines, 4 workers each (run one line on each machine):
  shardwise run --worker_num 8 --local_worker_num 4 --master_addr 10.0.0.1 --node_rank 0 train.py
  shardwise run --worker_num 8 --local_worker_num 4 --master_addr 10.0.0.1 --node_rank 1 train.py

logs: LOG_DIR/scheduler.log (the launcher) and LOG_DIR/worker_<rank>.log (each worker's output).
exit codes: 0 ok, 1 a worker failed, 2 bad options, 3 rendezvous failed, 128+N signal N.
"""


def parse_bool(text: str) -> bool:
    """Parse an msrun boolean.

    Args:
        text: ``True``/``False``/``1``/``0``/``yes``/``no``, any case.

    Returns:
        The boolean.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse turns it into a usage error).

    Example:
        >>> parse_bool("True"), parse_bool("0")
        (True, False)
    """
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise argparse.ArgumentTypeError(
        f"expected True/False (or true/false, yes/no, 1/0), got {text!r}"
    )


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= MAX_SECONDS:  # (inf and nan too: the workers' timeouts refuse them)
        raise argparse.ArgumentTypeError(
            f"must be more than 0 seconds and at most {MAX_SECONDS:.10g} (fractions allowed), "
            f"got {text}"
        )
    return value


def _host(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected the host name or IP address of node 0, got {text!r}"
        )
    return text


# name, type, default, metavar, help
_OPTIONS: list[tuple[str, Callable[[str], object], object, str, str]] = [
    ("worker_num", _int_at_least(1), 8, "N", "workers in the whole job, all nodes (default 8)"),
    (
        "local_worker_num",
        _int_at_least(1),
        None,
        "N",
        "workers started on this node (default: --worker_num, i.e. one node)",
    ),
    ("master_addr", _host, "127.0.0.1", "ADDR", "host of node 0, where the store runs"),
    ("master_port", _port, 8118, "PORT", "port of the rendezvous store (default 8118)"),
    (
        "node_rank",
        _int_at_least(-1),
        -1,
        "R",
        "index of this node; -1: the host of master_addr is 0, others get one in order",
    ),
    ("log_dir", str, ".", "DIR", "folder of scheduler.log and worker_<rank>.log (created)"),
    (
        "join",
        parse_bool,
        False,
        "BOOL",
        "True: wait for the job and print a summary; False: return once the workers run, "
        "supervising them in the background (default False)",
    ),
    ("cluster_time_out", _seconds, 600.0, "S", "seconds to wait for all workers (default 600)"),
    ("bind_core", parse_bool, False, "BOOL", "pin each worker to its own CPU cores"),
]
UNSUPPORTED_MSRUN = (
    "sim_level",
    "sim_rank_id",
    "rank_table_file",
    "worker_log_name",
    "tail_worker_log",
)
"""msrun options that ``shardwise run`` does not have (each takes a value): a usage error that
says so, not argparse's "unrecognized arguments"."""


def _spellings(names: Sequence[str]) -> frozenset[str]:
    return frozenset(s for name in names for s in (f"--{name}", f"--{name.replace('_', '-')}"))


_UNSUPPORTED = _spellings(UNSUPPORTED_MSRUN)
VALUE_OPTIONS = _spellings([name for name, *_ in _OPTIONS]) | _UNSUPPORTED


class _OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (the reason and where help is)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_run_parser(prog: str = "shardwise run") -> argparse.ArgumentParser:
    """The argparse parser of ``shardwise run`` (used for help and for the options).

    Example:
        >>> build_run_parser().parse_args(["x.py"]).worker_num
        8
    """
    parser = _OneLineParser(
        prog=prog,
        description="Start the workers of a distributed job on this node (msrun-compatible).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # (split_argv knows full spellings only: --master_p 1 ran "1")
    )
    for name, kind, default, metavar, text in _OPTIONS:
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
        parser.add_argument(
            *spellings, dest=name, type=kind, default=default, metavar=metavar, help=text
        )
    parser.add_argument("script", help="the Python script every worker runs")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script, passed untouched"
    )
    return parser


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split a command line into the launcher's options and ``[script, *script_args]``.

    The script is the first token that is neither an option nor an option's value; ``--``
    also ends the options.

    Example:
        >>> split_argv(["--worker_num", "2", "train.py", "--lr", "0.1"])
        (['--worker_num', '2'], ['train.py', '--lr', '0.1'])
    """
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--":
            return args[:i], args[i + 1 :]
        if not token.startswith("-") or token == "-":
            return args[:i], args[i:]
        i += 2 if token in VALUE_OPTIONS else 1
    return args, []


def parse_run_args(argv: Sequence[str], prog: str = "shardwise run") -> LaunchConfig:
    """Parse and validate ``shardwise run``'s command line.

    Args:
        argv: the arguments after ``shardwise run`` (or ``swrun``).
        prog: the command name for messages.

    Returns:
        The `LaunchConfig`.

    Raises:
        SystemExit: code 2 with a usage message for bad options, a missing script, or
            ``--local_worker_num`` above ``--worker_num``; code 0 after ``--help``.

    Example:
        >>> cfg = parse_run_args(["--worker-num", "4", "--local_worker_num=4", "setup.py", "--x"])
        >>> cfg.worker_num, cfg.script_args
        (4, ('--x',))
    """
    parser = build_run_parser(prog)
    options, command = split_argv(argv)
    unsupported = next((o for o in options if o.split("=", 1)[0] in _UNSUPPORTED), None)
    if unsupported is not None:
        supported = " ".join(f"--{name}" for name, *_ in _OPTIONS)
        parser.error(
            f"msrun option {unsupported.split('=', 1)[0]} is not supported by {prog} (it has "
            f"msrun's {supported}); remove it"
        )
    if not command:
        parser.parse_args([*options, "--", "script.py"])  # --help, or bad options, first
        parser.error(f"no script given: {prog} [options] script.py [script args]")
    ns = parser.parse_args([*options, "--", command[0]])
    if ns.local_worker_num is None:
        ns.local_worker_num = ns.worker_num
    cfg = LaunchConfig(
        script=ns.script,
        script_args=tuple(command[1:]),
        **{name: getattr(ns, name) for name, *_ in _OPTIONS},
    )
    problem = _problem(cfg)
    if problem:
        parser.error(problem)
    return cfg


def _problem(cfg: LaunchConfig) -> str | None:
    """The first inconsistency of `cfg` that argparse cannot see, or of the ``SHARDWISE_*``
    durations in the environment (each read by the function the job reads it with; the nodes'
    heartbeat timeout only for a job of several nodes), or None."""
    readers = [comm_timeout_s, *([] if cfg.single_node else [node_timeout]), stop_grace]
    for read in readers:
        try:
            read()
        except ValueError as e:
            return str(e)
    if cfg.local_worker_num > cfg.worker_num:
        return (
            f"--local_worker_num {cfg.local_worker_num} is more than --worker_num "
            f"{cfg.worker_num} (the workers of all nodes together)"
        )
    script = Path(cfg.script)
    if not script.exists():
        return f"script {cfg.script!r} does not exist (from {Path.cwd()})"
    if not script.is_file():
        return f"script {cfg.script!r} is not a file"
    max_node = cfg.worker_num - cfg.local_worker_num
    if not cfg.single_node and cfg.node_rank > max_node:
        return (
            f"--node_rank {cfg.node_rank} is impossible with --worker_num {cfg.worker_num} and "
            f"--local_worker_num {cfg.local_worker_num}: node ranks go from 0 to at most {max_node}"
        )
    return None


def _run(argv: Sequence[str], prog: str) -> int:
    cfg = parse_run_args(argv, prog)
    from shardwise.launch.detach import launch

    return launch(cfg)


def swrun_main(argv: Sequence[str] | None = None, prog: str = "swrun") -> int:
    """The ``swrun`` command: ``swrun [options] script.py [script args]``.

    Args:
        argv: the arguments (``sys.argv[1:]`` when None).
        prog: the command name for messages (``python -m shardwise.launch`` runs it too).

    Returns:
        The exit code (see ``swrun --help``).

    Example:
        >>> swrun_main(["--worker_num", "2", "--local_worker_num", "2", "--join", "True", "t.py"])
        0
    """
    return _run(sys.argv[1:] if argv is None else argv, prog)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``shardwise`` command: ``shardwise run ...`` (see ``shardwise --help``).

    Args:
        argv: the arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit code.

    Example:
        >>> main(["run", "--worker_num", "2", "--local_worker_num", "2", "--join", "True", "t.py"])
        0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        return _run(args[1:], "shardwise run")
    if args and args[0] == "plan":
        from shardwise.launch.dry_run import plan_main  # (imports the planner: only here)

        return plan_main(args[1:])
    parser = argparse.ArgumentParser(
        prog="shardwise", description="shardwise: MindSpore-style parallel training for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "run",
        help="start the workers of a distributed job (msrun-compatible; also `swrun`)",
        add_help=False,
    )
    commands.add_parser(
        "plan",
        help="plan a training script for N devices in this process, no devices needed (a dry "
        "run: plan.json, IR files, summary.txt)",
        add_help=False,
    )
    parser.parse_args(args)  # --help, or an error for an unknown command
    parser.print_help(sys.stderr)
    return EXIT_USAGE
