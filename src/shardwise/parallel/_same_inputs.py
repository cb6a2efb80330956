"""The check that the ranks agree on a call (`check_ranks_agree`), once per plan: the ranks
meant to pass the same input did, and every rank planned the call as rank 0 did.

Under ``full_batch`` every rank passes the whole global batch; under per-input dataset entries
the ranks a layout leaves an input replicated on pass the same block. A rank that passes other
values (its own rows under ``full_batch``, say) would train on a batch no other rank sees, and
nothing later notices: the first call of each plan compares each tensor input with the one its
leader rank passed (`communication.ranks_unlike_leader`: through the job's store, every rank
raises alike). In the same store round each rank's plan is compared with rank 0's (a rank
whose annotations depend on its rank plans other collectives, and the ranks would wait for each
other until the timeout), together with the shapes of its tensor inputs: ranks that passed
other shapes (unequal rows of the last batch) raise a ValueError naming the inputs and each
rank's shapes. A rank whose planning raised tells the others, which raise a ValueError naming
it instead of failing in their first collective.

A call is planned again only on the ranks whose inputs' shapes have no plan yet: a rank passed
a partial last batch plans, one passed as many rows as before runs its plan and waits in its
collectives. So before planning again each rank announces it (`announce_planning`, with its
inputs' shapes), and the check waits a short while for every rank's announcement: a rank that
never announces is named in a ValueError with this rank's shapes, the likely cause (unequal
rows in a last batch) and the fix, raised on the ranks that planned (the launcher then stops
the others, still in their collective), instead of every rank waiting until the timeout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from shardwise import communication as comm
from shardwise.layout import TensorLayout
from shardwise.parallel._call_io import input_layouts, tensor_inputs
from shardwise.planner import ParallelPlan


def _leader(layout: TensorLayout | None) -> Callable[[int], int]:
    """Rank -> the first rank holding the same block (`layout` None: the whole, rank 0's)."""
    if layout is None:
        return lambda r: 0
    axes = layout.replicated_axes()
    return lambda r: min(layout.matrix.group_along(r, axes)) if axes else r


def same_inputs(
    dataset: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, Any, Callable[[int], int]]]:
    """The tensor inputs the ranks must pass alike, each with its leader rank (none under
    ``"data_parallel"``): what `check_ranks_agree` compares, taken before the capture."""
    if dataset == "data_parallel":
        return []
    layouts = input_layouts(dataset, comm.get_group_size(), args, kwargs)
    return [
        (key, x, _leader(layouts.get(key)))
        for key, x in tensor_inputs(args, kwargs)
        if dataset == "full_batch" or key in layouts
    ]


def announce_planning(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Tell the other ranks that this rank plans this call again (its tensor inputs' shapes
    with it): the next `check_ranks_agree` waits for theirs (`comm.announce_planning`)."""
    comm.announce_planning(json.dumps(_shapes(args, kwargs)))


def check_ranks_agree(
    dataset: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    named: list[tuple[str, Any, Callable[[int], int]]],
    planned: ParallelPlan | BaseException,
) -> None:
    """Raise when the ranks did not all pass the inputs they must pass alike (`same_inputs`),
    or did not all plan the call alike: the plan (or the error planning raised) of every rank
    against rank 0's, in one round through the job's store (`communication.agree_with_ranks`).

    Raises:
        ValueError: (after `announce_planning`) some rank did not plan this call (naming this
            rank's input shapes, the ranks that did not, the likely cause and the fix: as many
            rows on every rank); an input differs (naming the input, the ranks that differ, the
            rank they should match and the fix: the same batch on every rank, or
            ``"data_parallel"``);
            another rank could not plan the call (naming it and its error); a rank passed
            inputs of other shapes than rank 0 (naming the inputs, both ranks' shapes and the
            fix: as many rows on every rank); a rank planned another plan than rank 0 (naming
            the first difference and the fix).
        The error `planned` holds, on the rank that raised it, when the inputs agree.
    """
    failed = planned if isinstance(planned, BaseException) else None
    plan = None if isinstance(planned, BaseException) else planned
    shapes = _shapes(args, kwargs)
    text = ""
    if plan is not None:
        text = json.dumps({"inputs": shapes, "plan": plan.to_dict()}, sort_keys=True)
    failure = None if failed is None else f"{type(failed).__name__}: {failed}"
    agreed = comm.agree_with_ranks(
        named, text, failure, lambda lead: _difference(lead, shapes, plan)
    )
    if agreed.absent:
        raise ValueError(_not_planned(agreed.absent, shapes)) from failed
    if agreed.unlike.count:
        layouts = input_layouts(dataset, comm.get_group_size(), args, kwargs)
        raise ValueError(_inputs_differ(dataset, layouts, agreed.unlike))
    if failed is not None:
        raise failed
    if agreed.failed is not None:
        rank, message = agreed.failed
        raise ValueError(
            f"AutoParallel: rank {rank} could not plan this call ({message}); every rank stops "
            f"here rather than wait for rank {rank} in a collective: fix rank {rank}'s error "
            f"(see its log); when it comes from annotations that differ between ranks, give "
            f"every rank the same annotations"
        )
    if agreed.differs is not None:
        rank, what = agreed.differs
        inputs, what = _told(what)
        if inputs:
            raise ValueError(_shapes_differ(rank, inputs))
        raise ValueError(
            f"AutoParallel: rank {rank} planned this call unlike rank 0 ({what}; rank 0's -> "
            f"rank {rank}'s), so the ranks would run different collectives and wait for each "
            f"other until SHARDWISE_COMM_TIMEOUT: give every rank the same annotations "
            f"(shard() strategies, layouts, dataset_strategy and the auto-parallel context), "
            f"not ones that depend on the rank"
        )


Shapes = list[list[Any]]  # ([input name, its shape] per tensor input, in call order)


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shapes:
    """Each tensor input's name and shape (a size that is not a plain int as its text)."""
    return [
        [key, [n if isinstance(n, int) else str(n) for n in x.shape]]
        for key, x in tensor_inputs(args, kwargs)
    ]


def _difference(leading: str, shapes: Shapes, plan: ParallelPlan | None) -> str:
    """How this rank's call differs from rank 0's (`leading`: its inputs' shapes and plan, as
    JSON), as JSON: ``{"inputs": [[name, rank 0's shape, this rank's], ...]}`` where the input
    shapes differ (a missing input's shape: None), else ``{"plan": first plan difference}``."""
    assert plan is not None  # (asked only of a rank that planned)
    lead = json.loads(leading)
    theirs, mine = dict(lead["inputs"]), dict(shapes)
    names = [*theirs, *(k for k in mine if k not in theirs)]
    inputs = [[k, theirs.get(k), mine.get(k)] for k in names if theirs.get(k) != mine.get(k)]
    if inputs:
        return json.dumps({"inputs": inputs})
    diff = ParallelPlan.from_dict(lead["plan"]).diff(plan)
    return json.dumps({"plan": diff[0] if diff else "differs"})


def _told(what: str) -> tuple[list[list[Any]], str]:
    """`_difference`'s answer read back: (the inputs whose shapes differ, the plan difference);
    a plain text (describing raised) is a plan difference."""
    try:
        told = json.loads(what)
    except ValueError:
        return [], what
    return list(told.get("inputs", [])), str(told.get("plan", "differs"))


def _shapes_differ(rank: int, inputs: list[list[Any]]) -> str:
    shown = "; ".join(
        f"{name}: {'none' if a is None else a} on rank 0, {'none' if b is None else b} on "
        f"rank {rank}"
        for name, a, b in inputs[:4]
    )
    more = f" (and {len(inputs) - 4} more inputs)" if len(inputs) > 4 else ""
    world = comm.get_group_size()
    return (
        f"AutoParallel: rank {rank} passed tensor inputs of other shapes than rank 0 ({shown}"
        f"{more}), so the ranks would plan different calls: every rank passes inputs of the "
        f"same shapes, as many rows on each rank (a global batch divisible by the {world} "
        f"ranks: drop the last, partial batch with batch(..., drop_remainder=True), or "
        f"DataLoader(drop_last=True))"
    )


def _not_planned(absent: tuple[int, ...], shapes: Shapes) -> str:
    shown = "; ".join(f"{name}: {shape}" for name, shape in shapes[:4])
    more = f" (and {len(shapes) - 4} more)" if len(shapes) > 4 else ""
    one = len(absent) == 1
    who = f"rank {absent[0]}" if one else f"ranks {', '.join(map(str, absent))}"
    rank, world = comm.get_rank(), comm.get_group_size()
    wait = comm.arrival_timeout().total_seconds()
    return (
        f"AutoParallel: rank {rank} planned this call again for inputs of new shapes ({shown}"
        f"{more}); {who} did not within {wait:g} s ({'it' if one else 'they'} kept "
        f"{'its' if one else 'their'} plan: unequal rows in a last, partial batch?). Pass as "
        f"many rows on every rank: a global batch divisible by the {world} ranks, batch(..., "
        f"drop_remainder=True), DataLoader(drop_last=True). (A rank busy that long "
        f"elsewhere: raise SHARDWISE_COMM_TIMEOUT)"
    )


def _inputs_differ(dataset: object, layouts: dict[str, TensorLayout], unlike: comm.Unlike) -> str:
    shown = list(zip(unlike.ranks, unlike.leaders, strict=True))[:4]
    pairs = ", ".join(f"rank {r} from rank {lead}'s" for r, lead in shown)
    more = f" (and {unlike.count - len(shown)} more ranks)" if unlike.count > len(shown) else ""
    layout = layouts.get(unlike.name)
    what = "every rank passes the whole global batch"
    if layout is not None:
        what = f"ranks holding the same block of it (layout {layout}) pass the same values"
    return (
        f"AutoParallel: dataset_strategy {_named(dataset)}: input {unlike.name} differs on "
        f"{pairs}{more} (bitwise), but {what}; pass the same values on those ranks, or set "
        f"dataset_strategy('data_parallel') where each rank passes its own rows"
    )


def _named(dataset: object) -> str:
    return repr(dataset) if isinstance(dataset, str) else "(per input)"
