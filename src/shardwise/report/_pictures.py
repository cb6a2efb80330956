"""The plan pictures `dump_parallel_plan` writes next to the IR files (``save_graphs >= 1``).

`dump_plan_pictures` writes ``rank_<r>/plan.html`` for every rank this process reports
(`_html.write_plan_html`, that rank marked) and ``plan.png`` once, in the directory of the
plan's first rank, for that rank (`_png.write_plan_png`: drawing it costs a matplotlib
import). A plan made again writes ``plan_<k>.html`` / ``plan_<k>.png``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

from shardwise.planner import ParallelPlan
from shardwise.report._html import write_plan_html
from shardwise.report._plan_data import Memory
from shardwise.report._png import write_plan_png

HTML_FILE = "plan.html"
PNG_FILE = "plan.png"


def picture_names(variant: int = 0) -> tuple[str, str]:
    """``("plan.html", "plan.png")``, or ``("plan_<k>.html", "plan_<k>.png")`` for the k-th plan
    made again."""
    if not variant:
        return HTML_FILE, PNG_FILE
    return HTML_FILE.replace(".html", f"_{variant}.html"), PNG_FILE.replace(
        ".png", f"_{variant}.png"
    )


def dump_plan_pictures(
    plan: ParallelPlan,
    root: Path,
    ranks: Sequence[int],
    variant: int = 0,
    memory: Memory | None = None,
) -> list[Path]:
    """Write ``root/rank_<r>/plan.html`` for each of `ranks`, and ``plan.png`` under the plan's
    first rank if it is one of them (without matplotlib: a warning, and no PNG).

    Returns:
        The paths written.
    """
    html_name, png_name = picture_names(variant)
    paths = [write_plan_html(plan, root / f"rank_{r}" / html_name, memory, r) for r in ranks]
    first = plan.matrix.rank_list[0]
    if first in ranks:
        try:
            paths.append(write_plan_png(plan, root / f"rank_{first}" / png_name, memory))
        except ImportError as e:
            warnings.warn(
                f"{png_name} not drawn: matplotlib is missing ({e}); install it "
                "(pip install matplotlib) to get the plan's picture",
                stacklevel=2,
            )
    return paths
