"""``shardwise plan [--device_num N] [--rank R] [--out DIR] script.py [args]``: a dry run.

The user's unchanged training script runs in this one process as rank R of an N-rank job
(`communication.dry_run`: a fake process group, no other process, no collective moves data),
with every parameter it builds on the meta device (`_meta_params.meta_parameters`: no memory,
no init compute; data and other tensors stay real). The first wrapped network
(``sw.AutoParallel`` or ``sw.Model``) that plans stops the script
(`parallel._observe.add_plan_hook`); nothing is cut, allocated or run. Then:

- ``DIR/plan.json``: the `ParallelPlan` (`ParallelPlan.to_dict`);
- ``DIR/rank_<R>/step_parallel_begin.ir`` and ``execute.ir``: the IR files of rank R, as
  ``save_graphs=1`` writes them in the real job (``execute.ir`` with its gradient-bucket or
  optimizer-parallel section);
- ``DIR/summary.txt``: rank R's memory by kind and its peak, the bytes it sends per step by
  collective kind and mesh axis with counts, and the cost model's step estimate
  (`report._summary`);
- ``DIR/plan.html`` and ``DIR/plan.png``: the plan pictures (`report.write_plan_html` /
  `write_plan_png`), with this estimate's memory per rank and rank R marked.

- `plan_main`: the command (argument parsing, errors with exit codes).
- `dry_plan`: run a script and return what it planned (`Planned`), or raise `DryRunError`.
- `write_outputs`: the files above.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm  # type: ignore[import-untyped]

from shardwise import communication
from shardwise.launch._meta_params import meta_parameters
from shardwise.parallel._observe import Planned, add_plan_hook, add_unplanned_hook
from shardwise.planner import PlanError, regathered_params
from shardwise.report import (
    format_plan_begin,
    format_plan_execute,
    write_plan_html,
    write_plan_png,
)
from shardwise.report._summary import (
    estimate_memory,
    find_optimizer,
    format_summary,
    optimizer_state_per_element,
    step_traffic,
)
from shardwise.report._write import BEGIN_FILE, EXECUTE_FILE, with_optimizer, write_ir


class DryRunError(RuntimeError):
    """The script could not be planned: it never called a wrapped network, or failed first."""


class DryPlanError(DryRunError, PlanError):
    """The script's wrapped network failed to plan with a user error (a `PlanError` or another
    ValueError: a strategy the device count does not divide, a memory cap): still one, named
    with the script."""


class _Stop(BaseException):
    """Raised by the plan hook to end the script once it has planned (not an `Exception`, so
    that a script's ``except Exception`` does not swallow it)."""

    def __init__(self, planned: Planned) -> None:
        super().__init__("planned")
        self.planned = planned


class _Unplanned(BaseException):
    """Raised by the unplanned-run hook: the script's wrapped network has no plan to show."""

    def __init__(self, mode: str) -> None:
        super().__init__(mode)
        self.mode = mode


@contextlib.contextmanager
def _kept_globals() -> Iterator[None]:
    """Put back what a script sets for its process (shardwise's contexts, the memory cap, the
    random states) once the dry run stops it: `dry_plan` can run in a process that goes on."""
    import random

    import numpy as np

    from shardwise import context, runtime
    from shardwise.parallel import _context

    saved = (
        copy.deepcopy(_context._CONTEXT),
        dict(context._CONTEXT),
        runtime.get_memory(),
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    try:
        yield
    finally:
        parallel, report, cap, rng, py_rng, np_rng = saved
        _context._CONTEXT.clear()
        _context._CONTEXT.update(parallel)
        context._CONTEXT.clear()
        context._CONTEXT.update(report)
        runtime.set_memory(cap)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)


@contextlib.contextmanager
def _script_argv(script: str, args: Sequence[str]) -> Iterator[None]:
    saved, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved, saved_path


def dry_plan(script: str, args: Sequence[str], device_num: int, rank: int = 0) -> Planned:
    """Run `script` as rank `rank` of `device_num` until its first plan (module docstring).

    Args:
        script: the training script's path.
        args: its arguments.
        device_num: the job's size.
        rank: the rank played.

    Returns:
        The `Planned` event (plan, graph, network, optimizers, buckets).

    Raises:
        DryRunError: the script ended (or exited) without calling a wrapped network, or its
            wrapped network failed to plan (the planner's error, a `PlanError` among them,
            named and chained: a strategy the device count does not divide, a memory cap).
        ValueError: a bad device count or rank (`communication.dry_run`).

    Example:
        >>> planned = dry_plan("examples/quick_start.py", [], device_num=1024)
        >>> planned.plan.device_num
        1024
    """

    def stop(event: Planned) -> None:
        # (found now, while the script's objects are alive)
        found = find_optimizer(event.network, event.optimizers)
        optimizers = (found,) if found is not None else ()
        raise _Stop(dataclasses.replace(event, optimizers=optimizers))

    def unplanned(mode: str) -> None:
        raise _Unplanned(mode)

    handle = add_plan_hook(stop)
    unplanned_handle = add_unplanned_hook(unplanned)
    try:
        with (
            communication.dry_run(device_num, rank),
            _script_argv(script, args),
            _kept_globals(),
            meta_parameters(),
        ):
            runpy.run_path(script, run_name="__main__")
    except _Stop as done:
        return done.planned
    except _Unplanned as run:
        raise DryRunError(
            f"{script}: its wrapped network runs parallel_mode={run.mode!r}, which has no plan "
            f"(the whole network runs on every rank, its gradients all-reduced). shardwise plan "
            f"plans semi_auto, sharding_propagation or recursive_programming; to see memory and "
            f"traffic per rank, dry-run it with parallel_mode='semi_auto' (with no annotation "
            f"every op runs data parallel there too)"
        ) from None
    except Exception as e:  # (the script's own failure, or its wrapped network's)
        if _in_wrapped_call(e):
            kind = DryPlanError if isinstance(e, ValueError) else DryRunError
            raise kind(
                f"{script}: its wrapped network failed to plan: {type(e).__name__}: {e}"
            ) from e
        raise DryRunError(
            f"{script} failed before any wrapped network planned: {type(e).__name__}: {e} "
            f"(in a dry run parameters are meta tensors and collectives return their input: a "
            f"script cannot compute with its network, or check what a collective returns, "
            f"before the first call of the wrapped one)"
        ) from e
    except SystemExit as e:
        raise DryRunError(
            f"{script} exited (code {e.code}) before any wrapped network planned; "
            f"check its arguments for a {device_num}-device job"
        ) from None
    finally:
        handle.remove()
        unplanned_handle.remove()
    raise DryRunError(
        f"{script} never called a wrapped network: shardwise plan stops at the first call of "
        f"an sw.AutoParallel (parallel_mode semi_auto, sharding_propagation or "
        f"recursive_programming) or an sw.Model under such a context; wrap the network or the "
        f"train step the script trains"
    )


def _in_wrapped_call(e: BaseException) -> bool:
    """Whether `e` was raised inside a wrapped network's call (its traceback passes through
    shardwise's ``parallel`` or ``planner`` packages): the planner's or the network's error,
    not the script's own before it."""
    inside = (
        f"{os.sep}shardwise{os.sep}parallel{os.sep}",
        f"{os.sep}shardwise{os.sep}planner{os.sep}",
    )
    return any(
        any(part in frame.filename for part in inside)
        for frame in traceback.extract_tb(e.__traceback__)
    )


def write_outputs(planned: Planned, out: Path, rank: int, header: Sequence[str] = ()) -> None:
    """Write plan.json, rank R's IR files and summary.txt into `out` (module docstring).

    Example:
        >>> write_outputs(dry_plan("train.py", [], 64), Path("plan_64"), rank=0)
    """
    plan = planned.plan
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    write_ir(out, rank, BEGIN_FILE, format_plan_begin(plan, 1))
    execute = format_plan_execute(plan, rank, 1)
    if planned.buckets is not None:  # (as ``save_graphs=1`` appends it: `dump_optimizer`)
        again = regathered_params(plan) if planned.hsdp is not None else None
        execute = with_optimizer(execute, planned.buckets, plan.matrix, rank, 1, again)
    write_ir(out, rank, EXECUTE_FILE, execute)
    optimizer = find_optimizer(planned.network, planned.optimizers)
    state = optimizer_state_per_element(optimizer)
    memory = estimate_memory(plan, planned.buckets, state, rank)
    traffic = step_traffic(plan, rank, planned.buckets)
    what = type(optimizer).__name__ if optimizer is not None else "none found"
    lines = [*header, f"optimizer: {what} ({state} state elements per parameter element)"]
    if planned.hsdp is not None:
        lines.append(f"optimizer parallel: {planned.hsdp}")
    (out / "summary.txt").write_text(format_summary(plan, memory, traffic, lines))
    per_rank = {r: dict(memory.parts) for r in range(plan.device_num)}  # (equal blocks)
    write_plan_html(plan, out / "plan.html", memory=per_rank, rank=rank)
    try:
        write_plan_png(plan, out / "plan.png", memory=per_rank, rank=rank)
    except ImportError as e:  # (matplotlib missing: the HTML says the same)
        print(f"shardwise plan: plan.png skipped ({e})", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwise plan",
        description="Plan a training script for N devices in this process (a dry run): no "
        "processes, no collectives, no compute. Writes plan.json, the IR files of one rank, "
        "summary.txt (memory per rank, bytes per step, step-time estimate), plan.html and "
        "plan.png.",
    )
    p.add_argument("--device_num", "--device-num", type=int, default=8, help="devices (8)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose files are written (0)")
    p.add_argument("--out", type=Path, default=Path("shardwise_plan"), help="output folder")
    p.add_argument("script", help="the training script")
    rest = p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    rest.required = False  # (argparse names a REMAINDER required: only the script is)
    return p


def plan_main(argv: Sequence[str]) -> int:
    """The ``shardwise plan`` command (module docstring). Exit codes: 0 planned, 1 the script
    could not be planned (the reason on stderr), 2 bad options.

    Example:
        >>> plan_main(["--device_num", "1024", "examples/quick_start.py"])
        0
    """
    parser = _parser()
    a = parser.parse_args(list(argv))
    if a.device_num < 1:
        parser.error(f"--device_num {a.device_num}: must be at least 1")
    if not 0 <= a.rank < a.device_num:
        parser.error(f"--rank {a.rank}: must be from 0 to {a.device_num - 1} (--device_num)")
    if not Path(a.script).is_file():
        parser.error(f"{a.script}: no such script")
    if a.out.exists() and not a.out.is_dir():
        parser.error(f"--out {a.out}: a file of that name exists; name a folder")
    start = time.perf_counter()
    bar = tqdm(  # (only on a terminal: redirected output gets no carriage-return lines)
        total=2,
        desc="shardwise plan",
        delay=1.0,
        file=sys.stderr,
        leave=False,
        disable=not sys.stderr.isatty(),
    )
    try:
        planned = dry_plan(a.script, a.args, a.device_num, a.rank)
        bar.update(1)
        secs = time.perf_counter() - start
        header = [f"shardwise plan {a.script} on {a.device_num} devices (rank {a.rank})"]
        header.append(f"planned in {secs:.2f} s")
        write_outputs(planned, a.out, a.rank, header)
        bar.update(1)
    except (DryRunError, PlanError, ValueError, OSError) as e:
        bar.close()
        print(f"shardwise plan: {e}", file=sys.stderr)
        return 1
    bar.close()
    print(
        f"shardwise plan: {a.out}/plan.json, {a.out}/rank_{a.rank}/*.ir, {a.out}/summary.txt, "
        f"{a.out}/plan.html, {a.out}/plan.png"
    )
    return 0
