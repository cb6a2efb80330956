"""An operator strategy file edited by hand (or written by another shardwise version) is
refused at the first call, naming the first op or edge that is inconsistent: an op's inputs
placed other than its edges leave them, an edge taking other steps than its placements need,
an op placed as this network places it running other collectives. A consistent file of other
annotations runs as saved.

The loaded plan was checked for its ops, shapes, parameters and buckets only, then run as
written: a deleted collective of a row-parallel MatMul ran without it (a wrong loss, no
error), a deleted redistribution step was still taken while the reports printed the file's
steps, and a changed placement was printed but not run (`planner.check_decisions`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan, StrategyFileError
from shardwise.testing import assert_matches_single_device, simulated_world

X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


class RowParallel(nn.Module):
    """Column- then row-parallel MatMuls: the second runs its own AllReduce over mp."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(16, 32) * 0.1)
        self.w2 = nn.Parameter(torch.randn(32, 8) * 0.1)
        self.mm1 = sw.ops.MatMul().shard(((2, 1), (1, 2)))
        self.mm2 = sw.ops.MatMul().shard(((2, 2), (2, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm2(torch.relu(self.mm1(x, self.w1)), self.w2).pow(2).mean()
        return out


def _run(mode: str, load: Path | None = None, save: Path | None = None) -> tuple[Any, ParallelPlan]:
    net = RowParallel()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = AutoParallel(net, parallel_mode=mode)
        if load is not None:
            parallel.load_operator_strategy_file(load)
        loss = parallel(world.rows(X))
        if save is not None:
            parallel.save_operator_strategy_file(save)
    assert parallel.parallel_plan is not None
    return loss, parallel.parallel_plan


def _drop_comm(d: dict[str, Any]) -> None:
    (node,) = [n for n in d["nodes"] if n["comms"]]
    node["comms"] = []


def _drop_step(d: dict[str, Any]) -> None:
    (edge,) = [e for e in d["edges"] if e["steps"] and e["steps"][0]["kind"] == "AllGather"]
    edge["steps"] = []


def _move_input(d: dict[str, Any]) -> None:
    d["nodes"][0]["inputs"][0] = {"dims": [[0, 1], []]}  # (rows over both axes, no edge made)


EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "collective deleted": (
        _drop_comm,
        r"op %2 mm2/MatMul is placed as this network places it but its comms differ \(file -> "
        r"this network\): \(\) -> \(AllReduce\(sum\) over g1 at mm2/MatMul\)",
    ),
    "step deleted": (
        _drop_step,
        r"the edge moving input:args\[0\] from \(\(g0, g1\), None\) to \(g0, None\) takes no "
        r"step, but those placements need AllGather\(dim=0, axis=g1",
    ),
    "placement changed": (
        _move_input,
        r"op %0 mm1/MatMul takes input 0 \(input:args\[0\]\) as \(\(g0, g1\), None\), but the "
        r"edge into it makes \(g0, None\)",
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_semi_auto_file_is_refused_at_its_first_difference(
    tmp_path: Path, edit: str
) -> None:
    want = RowParallel()(X)
    loss, _ = _run("semi_auto", save=tmp_path / "ops.json")
    assert_matches_single_device(loss, want.detach(), what="loss")
    loss, _ = _run("semi_auto", load=tmp_path / "ops.json")  # (unedited: runs)
    assert_matches_single_device(loss, want.detach(), what="loss from the file")
    data = json.loads((tmp_path / "ops.json").read_text())
    change, match = EDITS[edit]
    change(data)
    (tmp_path / "edited.json").write_text(json.dumps(data))
    with pytest.raises(StrategyFileError, match=match) as info:
        _run("semi_auto", load=tmp_path / "edited.json")
    assert str(info.value).endswith("written by another shardwise version: save it again")


class Unannotated(RowParallel):
    """The same network without its strategies (the file sets them)."""

    def __init__(self) -> None:
        super().__init__()
        self.mm1, self.mm2 = sw.ops.MatMul(), sw.ops.MatMul()


def test_the_file_of_an_annotated_network_runs_in_an_unannotated_one(tmp_path: Path) -> None:
    """The file's plan is not what this network would plan (its MatMuls run data parallel),
    but it is consistent: it runs as saved (a directive, as MindSpore's strategy file)."""
    want = RowParallel()(X)
    _, saved = _run("semi_auto", save=tmp_path / "ops.json")
    net = Unannotated()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = AutoParallel(net).load_operator_strategy_file(tmp_path / "ops.json")
        loss = parallel(world.rows(X))
    assert_matches_single_device(loss, want.detach(), what="loss")
    assert parallel.parallel_plan is not None and parallel.parallel_plan.diff(saved) == []
    assert tuple(net.w1.shape) == (16, 16)  # (stored as the file says: columns over mp)


def test_an_edited_propagated_file_is_refused_where_it_agrees_with_semi_auto(
    tmp_path: Path,
) -> None:
    """A sharding_propagation file runs without propagating again; an op it places as
    semi_auto would must still run the same collectives."""
    want = RowParallel()(X)
    _run("sharding_propagation", save=tmp_path / "ops.json")
    loss, plan = _run("sharding_propagation", load=tmp_path / "ops.json")
    assert plan.mode == "sharding_propagation"
    assert_matches_single_device(loss, want.detach(), what="loss from the file")
    data = json.loads((tmp_path / "ops.json").read_text())
    _drop_comm(data)
    (tmp_path / "edited.json").write_text(json.dumps(data))
    with pytest.raises(StrategyFileError, match=r"op %2 mm2/MatMul is placed as this network"):
        _run("sharding_propagation", load=tmp_path / "edited.json")


def test_diff_names_a_difference_the_printed_op_does_not_show(tmp_path: Path) -> None:
    """Two plans that differ in an op's collectives only printed that op twice, alike."""
    _, plan = _run("semi_auto", save=tmp_path / "ops.json")
    data = json.loads((tmp_path / "ops.json").read_text())
    _drop_comm(data)
    (line,) = ParallelPlan.from_dict(data).diff(plan)
    assert line == "node %2 mm2/MatMul comms: () -> (AllReduce(sum) over g1 at mm2/MatMul)"


PARAM_EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "another dtype": (
        lambda d: d["params"]["w1"].update(dtype="float16"),
        r"parameter 'w1' is float16 in the file but float32 in this network",
    ),
    "no dtype": (
        lambda d: d["params"]["w1"].update(dtype="floatx"),
        r"not a shardwise parameter strategy file \(parameter 'w1': dtype 'floatx' is not a ",
    ),
    "device_num not an int": (
        lambda d: d.update(device_num=4.5),
        r"not a shardwise parameter strategy file \(device_num 4.5 is not a positive int\)",
    ),
    "dims for another rank": (
        lambda d: d["params"]["w1"].update(dims=[[0], [], []]),
        r"\(parameter 'w1': layout \(g0, None, None\) on .* has 3 dims, its shape \[16, 32\] 2\)",
    ),
}


@pytest.mark.parametrize("edit", list(PARAM_EDITS))
def test_an_edited_parameter_file_is_refused(tmp_path: Path, edit: str) -> None:
    """A parameter strategy file of another dtype (or none torch has), a fractional device
    count (read as its int part) or a layout of another rank than the parameter (a bare
    ValueError from a redistribution) loaded silently or unclearly."""
    net = RowParallel()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        parallel(world.rows(X))
        parallel.save_param_strategy_file(tmp_path / "params.json")
    data = json.loads((tmp_path / "params.json").read_text())
    change, match = PARAM_EDITS[edit]
    change(data)
    (tmp_path / "edited.json").write_text(json.dumps(data))
    net = RowParallel()
    with simulated_world(4) as world:
        world.replicate(net)
        with pytest.raises(StrategyFileError, match=match):
            AutoParallel(net).load_param_strategy_file(tmp_path / "edited.json")(world.rows(X))
