"""``plan.png``: a `planner.ParallelPlan` in one picture, drawn with matplotlib (Agg, no display).

`write_plan_png` draws three panels on a figure of fixed size (so the file stays small however
large the plan is) and writes it:

- `_draw_matrix`: the device matrix: every rank at its coordinate (the last axis across, a
  colour per coordinate of the first axis; rank numbers written up to `NUMBERED_RANKS`), the
  chosen rank framed.
- `_draw_memory`: per-rank memory as stacked bars, one colour per kind, ranks with equal
  breakdowns merged (`_plan_data.memory_groups`).
- `_draw_comms`: one forward's collectives by kind and axes with the bytes the chosen rank sends
  (the `MAX_COMM_BARS` largest; the rest as one bar).

matplotlib is imported when a picture is drawn, not with ``shardwise.report``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardwise._atomic import write_bytes_atomically
from shardwise.layout import DeviceMatrix
from shardwise.planner import ParallelPlan
from shardwise.report._plan_data import (
    CommTotal,
    Memory,
    chosen_rank,
    comm_totals,
    fmt_bytes,
    matrix_rows,
    memory_groups,
    memory_kinds,
    plan_memory,
    plan_sends,
)

NUMBERED_RANKS = 128
MAX_COMM_BARS = 12
LABELLED_ROWS = 32
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))


def _unit(top: float) -> tuple[int, str]:
    """The unit to plot values up to `top` bytes in."""
    return next((size, name) for size, name in _UNITS if top >= size or size == 1)


def _draw_matrix(ax: Any, matrix: DeviceMatrix, rank: int) -> None:
    from matplotlib.patches import Rectangle

    rows = matrix_rows(matrix)
    cols = max(len(ranks) for _, ranks in rows)
    grid = [[math.nan] * cols for _ in rows]
    for i, (_, ranks) in enumerate(rows):
        for j, r in enumerate(ranks):
            grid[i][j] = matrix.coord(r)[0]
            if r == rank:  # (the chosen rank, framed)
                frame = Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", lw=2.5)
                ax.add_patch(frame)
    ax.imshow(grid, cmap="tab20", vmin=0, vmax=max(matrix.shape[0] - 1, 1), aspect="auto")
    if matrix.size <= NUMBERED_RANKS:
        size = 9 if matrix.size <= 32 else 6
        for i, (_, ranks) in enumerate(rows):
            for j, r in enumerate(ranks):
                ax.text(j, i, str(r), ha="center", va="center", fontsize=size)
    every = max(1, math.ceil(len(rows) / LABELLED_ROWS))
    ax.set_yticks(range(0, len(rows), every))
    ax.set_yticklabels([rows[i][0] for i in range(0, len(rows), every)], fontsize=7)
    ax.set_xticks(range(0, cols, max(1, math.ceil(cols / 16))))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel(f"{matrix.names[-1]} (across); colour: {matrix.names[0]}", fontsize=8)
    axes = " x ".join(f"{n}={s}" for n, s in zip(matrix.names, matrix.shape, strict=True))
    ax.set_title(f"device matrix {axes} ({matrix.size} ranks; rank {rank} framed)", fontsize=9)


def _draw_memory(ax: Any, memory: Memory) -> None:
    kinds = memory_kinds(memory)
    bars, left_out = memory_groups(memory, kinds)
    ax.set_title("memory per rank", fontsize=9)
    if not bars:
        ax.text(0.5, 0.5, "no memory breakdown", ha="center", transform=ax.transAxes)
        return
    scale, unit = _unit(max(b.total for b in bars))
    x = list(range(len(bars)))
    bottoms = [0.0] * len(bars)
    for k, kind in enumerate(kinds):
        heights = [b.parts[k] / scale for b in bars]
        ax.bar(x, heights, bottom=bottoms, label=kind, color=PALETTE[k % len(PALETTE)])
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xlim(-1, max(len(bars), 3))
    ax.set_xticks(x)
    ax.set_xticklabels([b.label for b in bars], rotation=45 if len(bars) > 6 else 0, fontsize=7)
    ax.set_xlabel("ranks" + (f" ({left_out} smaller groups not drawn)" if left_out else ""))
    ax.set_ylabel(unit, fontsize=8)
    ax.legend(fontsize=7, loc="lower right")


def _draw_comms(ax: Any, totals: Sequence[CommTotal], rank: int) -> None:
    whole = sum(t.send_bytes for t in totals)
    ax.set_title(f"collectives of one forward: rank {rank} sends {fmt_bytes(whole)}", fontsize=9)
    if not totals:
        ax.text(0.5, 0.5, "no collective", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    shown = list(totals[:MAX_COMM_BARS])
    labels = [f"{t.label} (x{t.count})" for t in shown]
    values = [t.send_bytes for t in shown]
    if len(totals) > MAX_COMM_BARS:
        rest = totals[MAX_COMM_BARS:]
        labels.append(f"{len(rest)} others")
        values.append(sum(t.send_bytes for t in rest))
    scale, unit = _unit(max(values))
    y = list(range(len(values)))
    drawn = ax.barh(y, [v / scale for v in values], color=PALETTE[0])
    ax.bar_label(drawn, labels=[fmt_bytes(v) for v in values], fontsize=7, padding=2)
    ax.margins(x=0.2)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} sent", fontsize=8)


def render_plan_png(
    plan: ParallelPlan, memory: Memory | None = None, rank: int | None = None
) -> bytes:
    """The bytes of ``plan.png`` (see `write_plan_png`).

    Raises:
        ValueError: `rank` is not a rank of the plan's matrix.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rank = chosen_rank(plan.matrix, rank)
    memory = plan_memory(plan) if memory is None else memory
    fig = Figure(figsize=(16, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 3, width_ratios=(1.1, 1.0, 1.3), wspace=0.45)
    _draw_matrix(fig.add_subplot(grid[0]), plan.matrix, rank)
    _draw_memory(fig.add_subplot(grid[1]), memory)
    _draw_comms(fig.add_subplot(grid[2]), comm_totals(plan_sends(plan, rank)), rank)
    fig.suptitle(
        f"ParallelPlan ({plan.mode}, {plan.device_num} devices, {len(plan.nodes)} ops) "
        f"on {plan.matrix}",
        fontsize=11,
    )
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.86)
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def write_plan_png(
    plan: ParallelPlan,
    path: str | os.PathLike[str],
    memory: Memory | None = None,
    rank: int | None = None,
) -> Path:
    """Draw `plan` in one PNG (matplotlib, Agg): the device matrix with its named axes and
    `rank` framed, per-rank memory as stacked bars, and one forward's collectives by kind and
    axes with the bytes `rank` sends. The figure has a fixed size (1600 x 550 pixels) for any
    plan.

    Args:
        plan: the plan (`AutoParallel.parallel_plan`, `planner.plan_semi_auto`, ...).
        path: the file to write (folders created; written atomically).
        memory: rank -> {kind: bytes}, stacked in the order given (any kinds); None:
            `plan_memory(plan)` (parameters, gradients, activations of the blocks).
        rank: the rank framed and whose bytes are drawn (default: the plan's first rank).

    Returns:
        The path written.

    Raises:
        ValueError: `rank` is not a rank of the plan's matrix.

    Example:
        >>> write_plan_png(parallel_net.parallel_plan, "saved_graph/plan.png", rank=5)
        PosixPath('saved_graph/plan.png')
    """
    return write_bytes_atomically(path, render_plan_png(plan, memory, rank))
