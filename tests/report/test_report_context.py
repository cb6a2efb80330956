"""`sw.set_context` / `get_context`: the report options and their validation; the numbered
report files of several plans, in one process and across runs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.context import get_context, get_seed, set_context, set_seed
from shardwise.testing import simulated_world


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    yield
    set_context(save_graphs=0, save_graphs_path="./saved_graph")


def test_defaults_and_set() -> None:
    assert get_context("save_graphs") == 0
    assert get_context("save_graphs_path") == "./saved_graph"
    set_context(save_graphs=2, save_graphs_path=Path("/tmp/g"))
    assert get_context("save_graphs") == 2
    assert get_context("save_graphs_path") == "/tmp/g"
    set_context(save_graphs=True)  # MindSpore's bool form
    assert get_context("save_graphs") == 1
    assert get_context("save_graphs_path") == "/tmp/g"  # untouched


@pytest.mark.parametrize("bad", [4, -1, 1.0, "1", [1]])
def test_bad_level(bad: object) -> None:
    with pytest.raises(ValueError, match=r"save_graphs=.* must be 0, 1, 2, 3"):
        set_context(save_graphs=bad)  # type: ignore[arg-type]
    assert get_context("save_graphs") == 0


@pytest.mark.parametrize("bad", [3, b"/tmp", ["a"]])
def test_bad_path_type(bad: object) -> None:
    with pytest.raises(TypeError, match=r"save_graphs_path=.* must be a str or os.PathLike"):
        set_context(save_graphs_path=bad)  # type: ignore[arg-type]


def test_empty_path_and_nothing_half_set() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        set_context(save_graphs=2, save_graphs_path="")
    assert get_context("save_graphs") == 0  # validation happens before any change


def test_unknown_option() -> None:
    with pytest.raises(ValueError, match=r"unknown option 'mode'.*save_graphs"):
        get_context("mode")
    with pytest.raises(TypeError):
        set_context(mode=0)  # type: ignore[call-arg]


def test_seed_untouched() -> None:
    set_seed(7)
    set_context(save_graphs=1)
    assert get_seed() == 7


def test_a_seed_torch_cannot_take_is_refused_before_seeding_anything() -> None:
    """``set_seed(2**64)`` seeded Python's random, then torch raised "Overflow when unpacking
    long long"."""
    set_seed(7)
    state = random.getstate()
    with pytest.raises(
        ValueError,
        match=r"set_seed: seed=18446744073709551616 is too large: "
        r"torch takes seeds below 2\*\*64 .*e\.g\. seed % 2\*\*64",
    ):
        set_seed(2**64)
    assert random.getstate() == state and get_seed() == 7
    set_seed(2**64 - 1)  # (the largest seed torch takes)
    assert get_seed() == 2**64 - 1


def test_a_second_network_does_not_overwrite_the_first_networks_reports(tmp_path: Path) -> None:
    """Two wrapped networks writing to one save_graphs_path: the second's first plan rewrote
    ``step_parallel_begin.ir``, ``execute.ir`` and ``plan.html``; it now writes the next
    ``_<k>`` files and the first network's stay as they were."""
    first, second = torch.nn.Linear(8, 4), torch.nn.Sequential(torch.nn.Linear(8, 6))
    x = torch.randn(8, 8)
    set_context(save_graphs=2, save_graphs_path=tmp_path)
    with simulated_world(2) as world:
        world.replicate(first)
        world.replicate(second)
        sw.AutoParallel(first)(world.rows(x))
        before = {p.name: p.read_text() for p in (tmp_path / "rank_1").glob("*.ir")}
        sw.AutoParallel(second)(world.rows(x))
    rank_1 = tmp_path / "rank_1"
    assert sorted(p.name for p in rank_1.iterdir()) == [
        "execute.ir",
        "execute_1.ir",
        "plan.html",
        "plan_1.html",
        "step_parallel_begin.ir",
        "step_parallel_begin_1.ir",
    ]
    assert {p: (rank_1 / p).read_text() for p in before} == before
    assert "[8, 6]" in (rank_1 / "step_parallel_begin_1.ir").read_text()


def test_a_rerun_leaves_no_numbered_plan_files_of_an_earlier_run(tmp_path: Path) -> None:
    """Numbered plan files an earlier run left in a rank directory (it made more plans) are
    removed at this process's first write there, and only those: other files stay, and the
    numbered files this process writes later (a plan made again, another network's) too."""
    stale = ["execute_1.ir", "execute_2.ir", "step_parallel_begin_1.ir", "plan_1.html"]
    other = ["execute_x.ir", "notes_1.ir", "plan_1.txt", "execute_1.ir.bak"]
    for r in (0, 1):
        (tmp_path / f"rank_{r}").mkdir()
        for name in stale + other:
            (tmp_path / f"rank_{r}" / name).write_text("an earlier run's\n")
    (tmp_path / "rank_0" / "plan_3.png").write_bytes(b"an earlier run's")
    net, second = torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)
    x, x_half = torch.randn(8, 8), torch.randn(4, 8)
    set_context(save_graphs=1, save_graphs_path=tmp_path)
    with simulated_world(2) as world:
        world.replicate(net)
        world.replicate(second)
        parallel = sw.AutoParallel(net)
        parallel(world.rows(x))
        names = {r: sorted(p.name for p in (tmp_path / f"rank_{r}").iterdir()) for r in (0, 1)}
        mine = ["execute.ir", "plan.html", "step_parallel_begin.ir"]
        assert names[1] == sorted(other + mine)
        assert names[0] == sorted([*other, *mine, "plan.png"])
        parallel(world.rows(x_half))  # (planned again: the _1 files)
        sw.AutoParallel(second)(world.rows(x))  # (the next: the _2 files)
    rank_1 = tmp_path / "rank_1"
    assert sorted(p.name for p in rank_1.iterdir()) == sorted(
        other
        + mine
        + ["execute_1.ir", "plan_1.html", "step_parallel_begin_1.ir"]
        + ["execute_2.ir", "plan_2.html", "step_parallel_begin_2.ir"]
    )
    assert "[4, 8]" in (rank_1 / "step_parallel_begin_1.ir").read_text()
    assert all((rank_1 / n).read_text() == "an earlier run's\n" for n in other)
