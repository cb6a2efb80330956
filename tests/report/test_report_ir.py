"""IR reports of seed 003's network (`shardwise.report`), formatted without processes.

The network is seed 003's (Flatten, MatMul ((2, 4), (4, 1)), ReLU ((4, 1),), MatMul ((1, 8),
(8, 1)), ReLU ((8, 1),), MatMul default) on 8 devices, global batch 32. The plan's global
matrix is (g0, g1, g2) = (2, 2, 2). Checked: strategies (user-set and chosen), global and local
shapes, the inserted communication ops with this rank's groups for ranks 0 and 5, levels 2 and
3, the writer, and that the communication ops of ``execute.ir`` are exactly the collectives a
simulated forward issues (kind, group, bytes).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from shardwise.communication import CommRecorder
from shardwise.context import set_context
from shardwise.parallel import AutoParallel, NetworkPlan, plan_network, trace_calls
from shardwise.report import (
    Dataflow,
    Source,
    dump_plan,
    format_execute,
    format_step_parallel_begin,
    trace_sources,
    write_ir,
)
from shardwise.report._parallel_plan import format_plan_execute
from shardwise.testing import simulated_world

WORLD, BATCH = 8, 32
SHAPES = [(BATCH, 1, 28, 28)]


sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from test_seed003_parity import Network  # noqa: E402  (seed 003's network, shared)


def planned(layouts: bool = False) -> tuple[NetworkPlan, Dataflow]:
    net = Network(layouts)
    return plan_network(trace_calls(net, SHAPES), WORLD), trace_sources(net, SHAPES)


def line(text: str, start: str) -> str:
    """The one line of `text` starting with `start`."""
    found = [x for x in text.splitlines() if x.startswith(start)]
    assert len(found) == 1, (start, text)
    return found[0]


def op_line(text: str, kind: str, instance: str) -> str:
    found = [
        x
        for x in text.splitlines()
        if f" = {kind}(" in x and f"{{instance name: {instance}," in x + ","
    ]
    assert len(found) == 1, (kind, instance, text)
    return found[0]


def comm_ops(text: str) -> Counter[tuple[str, tuple[int, ...]]]:
    """(kind, group) of every communication op in an execute.ir."""
    out: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for x in text.splitlines():
        m = re.match(r"%\d+ = (\w+)\(.*group: \[([\d, ]+)\]", x)
        if m:
            out[(m.group(1), tuple(int(r) for r in m.group(2).split(", ")))] += 1
    return out


def test_trace_sources() -> None:
    _, flow = planned()
    assert flow.calls[0] == (Source("input", 0),)
    assert flow.calls[1] == (Source("call", 0), Source("param", name="fc1_weight"))
    assert flow.calls[5] == (Source("call", 4), Source("param", name="fc3_weight"))
    assert flow.outputs == (Source("call", 5),)


@pytest.mark.parametrize("rank", [0, 5])
def test_step_parallel_begin(rank: int) -> None:
    plan, flow = planned()
    text = format_step_parallel_begin(plan, flow, rank)
    assert text.startswith(f"# shardwise IR: step_parallel_begin, rank {rank} of 8, save_graphs=1")
    assert "# device matrix: DeviceMatrix(g0=2, g1=2, g2=2)" in text
    assert line(text, "%input0 : [32, 1, 28, 28]")
    assert line(text, "%para_fc1_weight : [784, 512] {layout: ((g1, g2), None)}")
    mm1 = line(text, "%2 = MatMul(%1, %para_fc1_weight) {instance name: matmul1}")
    assert "in_strategy: ((2, 4), (4, 1)), in_strategy_from: user" in mm1
    assert "out_strategy: ((2, 1),), out_strategy_from: planner" in mm1
    assert "dev_matrix: [d0=2, d1=4, d2=1], forward_comms: AllReduce(sum) over d1" in mm1
    assert "in_layouts: ((g0, (g1, g2)), ((g1, g2), None))" in mm1
    assert mm1.endswith(": ([32, 784], [784, 512]) -> ([32, 512])")
    relu1 = line(text, "%3 = ReLU(%2) {instance name: relu1}")
    assert "dev_matrix: [d0=4, d1=1, repeat=2]" in relu1
    mm3 = line(text, "%6 = MatMul(%5, %para_fc3_weight) {instance name: matmul3}")
    assert "in_strategy: ((8, 1), (1, 1)), in_strategy_from: planner" in mm3
    assert mm3.endswith(": ([32, 512], [512, 10]) -> ([32, 10])")
    assert text.endswith("return(%6)\n")
    assert "#   rank" not in text  # the slice table is level 3


def test_step_parallel_begin_layout_strategies() -> None:
    plan, flow = planned(layouts=True)
    text = format_step_parallel_begin(plan, flow, 0)
    mm1 = line(text, "%2 = MatMul(")
    assert "in_strategy: (layout('mp', ('sp', 'dp')), layout(('sp', 'dp'), 'None'))" in mm1
    assert "out_strategy: (layout('mp', 'None'),), out_strategy_from: planner" in mm1
    assert "forward_comms: AllReduce(sum) over sp, dp" in mm1


def test_execute_rank0() -> None:
    plan, flow = planned()
    text = format_execute(plan, flow, 0)
    assert line(text, "%input0 : [4, 1, 28, 28]")
    assert line(text, "%para_fc1_weight : [196, 512]")
    assert line(text, "%para_fc2_weight : [64, 512]")
    # matmul1's x: ((g0, g1, g2), None) -> (g0, (g1, g2)): AllGather g2, AlltoAll g1, Slice g2
    ag = op_line(text, "AllGather", "matmul1/in0/redistribution_0")
    assert "dim: 0, axis: g2, group: [0, 1], group_size: 2, fusion: 0" in ag
    assert ag.endswith(": ([4, 784]) -> ([8, 784])")
    a2a = op_line(text, "AlltoAll", "matmul1/in0/redistribution_1")
    assert "src_dim: 0, dst_dim: 1, axis: g1, group: [0, 2]" in a2a
    sl = op_line(text, "StridedSlice", "matmul1/in0/redistribution_2")
    assert "dim: 1, axis: g2, parts: 2, keep: [0:196]" in sl
    mm1 = op_line(text, "MatMul", "matmul1")
    assert mm1.endswith(": ([16, 196], [196, 512]) -> ([16, 512])")
    assert "partial: AllReduce(sum) over d1" in mm1
    ar = op_line(text, "AllReduce", "matmul1/forward_op_0")
    assert "op: sum, axes: (d1), group: [0, 1, 2, 3], group_size: 4, fusion: 0" in ar
    ar2 = op_line(text, "AllReduce", "matmul2/forward_op_0")
    assert "group: [0, 1, 2, 3, 4, 5, 6, 7], group_size: 8" in ar2
    assert op_line(text, "MatMul", "matmul3").endswith(": ([4, 512], [512, 10]) -> ([4, 10])")
    assert "send_bytes" not in text  # level 2


def test_execute_rank5() -> None:
    plan, flow = planned()
    text = format_execute(plan, flow, 5)
    assert "rank 5 at coordinate (1, 0, 1)" in text
    assert "group: [4, 5]" in op_line(text, "AllGather", "matmul1/in0/redistribution_0")
    assert "group: [5, 7]" in op_line(text, "AlltoAll", "matmul1/in0/redistribution_1")
    assert "keep: [196:392]" in op_line(text, "StridedSlice", "matmul1/in0/redistribution_2")
    assert "group: [4, 5, 6, 7]" in op_line(text, "AllReduce", "matmul1/forward_op_0")
    assert comm_ops(text) == Counter(
        {
            ("AllGather", (4, 5)): 1,
            ("AlltoAll", (5, 7)): 1,
            ("AllReduce", (4, 5, 6, 7)): 1,
            ("AlltoAll", (1, 5)): 1,
            ("AllGather", (5, 7)): 1,
            ("AllReduce", (0, 1, 2, 3, 4, 5, 6, 7)): 1,
        }
    )


def test_levels_2_and_3() -> None:
    plan, flow = planned()
    two = format_execute(plan, flow, 0, level=2)
    assert "send_bytes: 12544" in op_line(two, "AllGather", "matmul1/in0/redistribution_0")
    # AllReduce of a [16, 512] float32 block over 4 ranks: 2 * 3/4 * 32768 bytes
    assert "send_bytes: 49152" in op_line(two, "AllReduce", "matmul1/forward_op_0")
    assert "#   rank 0 blocks: ([0:16, 0:196], [0:196, 0:512]) -> ([0:16, 0:512])" in two
    three = format_step_parallel_begin(plan, flow, 0, level=3)
    assert "#   rank 5: ([16:32, 196:392], [196:392, 0:512]) -> ([16:32, 0:512])" in three
    assert "layout_after: (g0, (g1, g2))" in format_execute(plan, flow, 0, level=3)


def test_bad_level_and_rank() -> None:
    plan, flow = planned()
    with pytest.raises(ValueError, match="level 4"):
        format_execute(plan, flow, 0, level=4)
    with pytest.raises(ValueError, match="rank 8"):
        format_step_parallel_begin(plan, flow, 8)
    with pytest.raises(ValueError, match="traced"):
        format_execute(plan, Dataflow(flow.calls[:2], flow.outputs), 0)


def plan_comm_ops(text: str) -> Counter[tuple[str, tuple[int, ...]]]:
    """(kind, group) of every collective in a plan's execute.ir."""
    out: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for x in text.splitlines():
        m = re.match(r"\s+(\w+)(?:\(\w+\))? over .* group \[([\d, ]+)\] send_bytes", x)
        if m:
            out[(m.group(1), tuple(int(r) for r in m.group(2).split(", ")))] += 1
    return out


@pytest.mark.parametrize("layouts", [False, True], ids=["int", "layout"])
def test_comm_ops_match_a_simulated_forward(layouts: bool) -> None:
    """Every collective of the plan's execute.ir (rank 0) is one the run issues, with the same
    group and bytes, and nothing else is issued (the report prints the plan: no second trace)."""
    net = Network(layouts)
    with simulated_world(WORLD) as world, CommRecorder() as rec:
        world.replicate(net)
        parallel = AutoParallel(net)
        parallel(world.rank_map(lambda r: torch.zeros(BATCH // WORLD, 1, 28, 28)))
    plan = parallel.parallel_plan
    assert plan is not None
    text = format_plan_execute(plan, 0)
    forward = Counter({(k, g): n for (k, phase, g), n in rec.kinds().items() if phase == "forward"})
    assert plan_comm_ops(text) == forward, rec.summary() + "\n" + text
    sent = sum(r.bytes_sent for r in rec.records)
    assert f"# bytes this rank sends in one forward: {sent}" in text, text


def test_write_ir_and_dump_plan(tmp_path: Path) -> None:
    path = write_ir(tmp_path / "a", 3, "x.ir", "hello\n")
    assert path == tmp_path / "a" / "rank_3" / "x.ir"
    assert path.read_text() == "hello\n"
    assert write_ir(tmp_path / "a", 3, "x.ir", "again\n").read_text() == "again\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.ir"]  # no temporary left
    net = Network()
    plan = plan_network(trace_calls(net, SHAPES), WORLD)
    try:
        set_context(save_graphs=0, save_graphs_path=tmp_path / "g")
        assert dump_plan(plan, net, SHAPES) == []
        set_context(save_graphs=1)
        written = dump_plan(plan, net, SHAPES)  # no process group: every rank
    finally:
        set_context(save_graphs=0, save_graphs_path="./saved_graph")
    assert len(written) == 16
    execute = (tmp_path / "g" / "rank_5" / "execute.ir").read_text()
    assert execute == format_execute(plan, trace_sources(net, SHAPES), 5)
    assert (tmp_path / "g" / "rank_0" / "step_parallel_begin.ir").is_file()


def test_full_batch_inputs() -> None:
    net = Network()
    plan = plan_network(trace_calls(net, SHAPES), WORLD)
    flow = trace_sources(net, SHAPES, input_states=["rep"])
    text = format_execute(plan, flow, 0)
    rep = "{layout: (None, None, None, None), arrives: full_batch}"
    assert line(text, f"%input0 : [32, 1, 28, 28] {rep}")
    # Flatten wants dim 0 split over all 8 ranks: local slices only, no collective before it
    first = text.split("= Flatten(")[0]
    assert "AllGather" not in first and "AlltoAll" not in first
    with pytest.raises(ValueError, match="dataset strategy"):
        dump_plan(plan, net, SHAPES, "stand_alone")


class WithTorchOp(Network):
    """Seed 003's network with an unannotated torch op between matmul1 and relu1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul1(self.flatten(x), self.fc1_weight) * 2.0
        logits: torch.Tensor = self.matmul3(self.relu1(x), self.fc3_weight)
        return logits


def test_unannotated_torch_op_input() -> None:
    net = WithTorchOp()
    plan = plan_network(trace_calls(net, SHAPES), WORLD)
    flow = trace_sources(net, SHAPES)
    assert flow.calls[2] == (Source("torch"),)
    text = format_execute(plan, flow, 0)
    assert "# relu1/in0: from an unannotated torch op, taken as data parallel" in text
    # data parallel ((g0, g1, g2), None) -> relu1's ((g0, g1), None): one AllGather over g2
    ag = op_line(text, "AllGather", "relu1/in0/redistribution_0")
    assert "axis: g2, group: [0, 1]" in ag and "(%torch_op)" in ag
