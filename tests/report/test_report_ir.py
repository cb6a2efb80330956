"""IR reports of a `ParallelPlan` (`shardwise.report`), for seed 003's network.

The network is seed 003's (Flatten, MatMul ((2, 4), (4, 1)), ReLU ((4, 1),), MatMul ((1, 8),
(8, 1)), ReLU ((8, 1),), MatMul default) on 8 devices, global batch 32. The plan's global
matrix is (g0, g1, g2) = (2, 2, 2). Checked: strategies (user-set and chosen) and where they
came from, global and local shapes, the collectives with this rank's groups for ranks 0 and 5,
levels 2 and 3, the writer, bad levels and ranks, and that the collectives of ``execute.ir``
are exactly those a simulated forward issues (kind, group, bytes). The edges' local slices
(``StridedSlice``, nothing sent) are listed too, for seed 003 and for seed 002's relu input.
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
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan, capture, plan_sharding_propagation
from shardwise.report import dump_parallel_plan, format_plan_begin, format_plan_execute, write_ir
from shardwise.testing import simulated_world

WORLD, BATCH = 8, 32
SHAPES = [(BATCH, 1, 28, 28)]


sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from test_seed003_parity import Network  # noqa: E402  (seed 003's network, shared)


def planned(layouts: bool = False, net: torch.nn.Module | None = None) -> ParallelPlan:
    """Seed 003's plan from the global input shape (no call runs)."""
    net = net if net is not None else Network(layouts)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        return AutoParallel(net).plan(shapes=SHAPES)


def line(text: str, start: str) -> str:
    """The one line of `text` that starts with `start` (leading blanks ignored)."""
    found = [x.strip() for x in text.splitlines() if x.strip().startswith(start)]
    assert len(found) == 1, (start, text)
    return found[0]


def after(text: str, start: str) -> str:
    """The line after the one line starting with `start`."""
    lines = [x.strip() for x in text.splitlines()]
    found = [i for i, x in enumerate(lines) if x.startswith(start)]
    assert len(found) == 1, (start, text)
    return lines[found[0] + 1]


def test_step_parallel_begin() -> None:
    text = format_plan_begin(planned())
    assert text.startswith("# step_parallel_begin: 6 ops\n")
    assert "on DeviceMatrix(g0=2, g1=2, g2=2)" in text
    assert line(text, "input args[0]:") == "input args[0]: ((g0, g1, g2), None, None, None)"
    mm1 = line(text, "%1 matmul1/MatMul [shardwise.ops.MatMul; user]")
    assert mm1.endswith(": (g0, (g1, g2)), ((g1, g2), None) -> (g0, None) [32, 512]")
    # (the strategy, who set it and the inputs' global shapes; the outputs' split counts)
    assert after(text, "%1 matmul1") == (
        "in_strategy ((2, 4), (4, 1)) from user; inputs [32, 784], [784, 512]"
    )
    assert after(text, "in_strategy ((2, 4), (4, 1))") == "out_strategy ((2, 1),)"
    assert line(text, "comm AllReduce(sum) over g1, g2 at matmul1/MatMul")
    assert after(text, "%2 relu1/ReLU") == "in_strategy ((4, 1),) from user; inputs [32, 512]"
    mm3 = line(text, "%5 matmul3/MatMul [shardwise.ops.MatMul; default]")
    assert mm3.endswith("-> ((g0, g1, g2), None) [32, 10]")
    assert after(text, "%5 matmul3") == (
        "in_strategy ((8, 1), (1, 1)) from default; inputs [32, 512], [512, 10]"
    )
    # Flatten's rows over all 8 ranks -> matmul1's (g0, (g1, g2)): the edge's steps
    edge = line(text, "edge %0 ((g0, g1, g2), None) -> (g0, (g1, g2)):")
    assert "AllGather(dim=0, axis=g2, group size 2); AlltoAll(dim 0 -> 1, axis=g1" in edge
    assert line(text, "param fc1_weight:") == "param fc1_weight: ((g1, g2), None) float32[784, 512]"
    assert "# rank" not in text  # the slice table is level 3


def test_step_parallel_begin_layout_strategies() -> None:
    """Layout strategies plan as their int twins (the same placements)."""
    ints, layouts = format_plan_begin(planned()), format_plan_begin(planned(layouts=True))
    for start in ("%1 matmul1", "%3 matmul2"):
        assert after(layouts, start) == after(ints, start)


def test_execute_rank0() -> None:
    text = format_plan_execute(planned(), 0)
    assert text.startswith("# execute: rank 0 of 8 on DeviceMatrix(g0=2, g1=2, g2=2)")
    assert line(text, "%0 flatten/Flatten: local [4, 784]")
    assert line(text, "%1 matmul1/MatMul: local [16, 512]")
    ag = line(text, "AllGather over g2 at matmul1/MatMul input 0")
    assert ag.endswith("group [0, 1] fusion 0 send_bytes 12544")
    assert line(text, "AlltoAll over g1 at matmul1/MatMul input 0").startswith(
        "AlltoAll over g1 at matmul1/MatMul input 0 group [0, 2]"
    )
    # AllReduce of a [16, 512] float32 block over 4 ranks: 2 * 3/4 * 32768 bytes
    ar = line(text, "AllReduce(sum) over g1, g2 at matmul1/MatMul group")
    assert ar.endswith("group [0, 1, 2, 3] fusion 0 send_bytes 49152")
    ar2 = line(text, "AllReduce(sum) over g0, g1, g2 at matmul2/MatMul group")
    assert "group [0, 1, 2, 3, 4, 5, 6, 7]" in ar2
    assert line(text, "%5 matmul3/MatMul: local [4, 10]")
    assert "block" not in text  # level 2
    # the edges' local slices (MindSpore's StridedSlice, begin / end in the block's coordinates)
    assert line(text, "Slice(dim=0, axis=g1, 2 parts) at relu1/ReLU input 0:") == (
        "Slice(dim=0, axis=g1, 2 parts) at relu1/ReLU input 0: "
        "StridedSlice((0, 0), (8, 512), (1, 1)) of local [16, 512] send_bytes 0"
    )
    # consecutive Slice steps of one edge: one StridedSlice
    assert line(text, "Slice(dim=1, axis=g1, 2 parts); Slice(dim=1, axis=g2, 2 parts) at").endswith(
        "at matmul2/MatMul input 0: StridedSlice((0, 0), (32, 64), (1, 1)) of local [32, 256] "
        "send_bytes 0"
    )


def test_execute_rank5() -> None:
    text = format_plan_execute(planned(), 5)
    assert plan_comm_ops(text) == Counter(
        {
            ("AllGather", (4, 5)): 1,
            ("AlltoAll", (5, 7)): 1,
            ("AllReduce", (4, 5, 6, 7)): 1,
            ("AlltoAll", (1, 5)): 1,
            ("AllGather", (5, 7)): 1,
            ("AllReduce", (0, 1, 2, 3, 4, 5, 6, 7)): 1,
        }
    )


def test_execute_seed002_strided_slice() -> None:
    """Seed 002 under sharding propagation: after matmul's AllReduce over 0-1-2-3, relu's input
    is cut locally to its 4 columns of 16, as the seed's ``StridedSlice(%13, (0, 0), (8, 4),
    (1, 1))``; rank 5 keeps columns 4:8."""
    from ..planner.test_propagate import Seed002

    plan = plan_sharding_propagation(capture(Seed002(), torch.zeros(16, 32)), WORLD)
    zero, five = format_plan_execute(plan, 0), format_plan_execute(plan, 5)
    assert line(zero, "AllReduce(sum) over g1 at matmul/MatMul").endswith(
        "group [0, 1, 2, 3] fusion 0 send_bytes 768"
    )
    assert line(zero, "Slice(dim=1, axis=g1, 4 parts) at relu/ReLU input 0:") == (
        "Slice(dim=1, axis=g1, 4 parts) at relu/ReLU input 0: "
        "StridedSlice((0, 0), (8, 4), (1, 1)) of local [8, 16] send_bytes 0"
    )
    assert "StridedSlice((0, 4), (8, 8), (1, 1)) of local [8, 16]" in five
    assert plan_comm_ops(zero) == Counter(
        {("AlltoAll", (0, 1, 2, 3)): 1, ("AllReduce", (0, 1, 2, 3)): 2}
    )


def test_levels_2_and_3() -> None:
    plan = planned()
    two = format_plan_execute(plan, 5, level=2)
    assert after(two, "%1 matmul1/MatMul: local") == (
        "block ([16:32, 196:392], [196:392, 0:512]) -> ([16:32, 0:512])"
    )
    three = format_plan_begin(plan, level=3)
    assert "# rank 5: ([16:32, 196:392], [196:392, 0:512]) -> ([16:32, 0:512])" in three
    assert three.count("# rank ") == 6 * WORLD  # every op, every rank


def test_bad_level_and_rank() -> None:
    plan = planned()
    with pytest.raises(ValueError, match="level 4"):
        format_plan_execute(plan, 0, level=4)
    with pytest.raises(ValueError, match="level 0"):
        format_plan_begin(plan, level=0)
    with pytest.raises(ValueError, match="rank 8"):
        format_plan_execute(plan, 8)
    for rank in (True, 1.0):  # (not printed as "rank True of 8")
        with pytest.raises(TypeError, match=rf"rank {rank!r}: the rank must be an int"):
            format_plan_execute(plan, rank)  # type: ignore[arg-type]


def plan_comm_ops(text: str) -> Counter[tuple[str, tuple[int, ...]]]:
    """(kind, group) of every collective in a plan's execute.ir, in its forward section."""
    out: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for x in text.partition("# backward")[0].splitlines():
        m = re.match(r"\s+(\w+)(?:\(\w+\))? over .* group \[([\d, ]+)\] fusion 0 send_bytes", x)
        if m:
            out[(m.group(1), tuple(int(r) for r in m.group(2).split(", ")))] += 1
    return out


@pytest.mark.parametrize(
    ("layouts", "dtype"),
    [(False, torch.float32), (True, torch.float32), (False, torch.float64)],
    ids=["int", "layout", "float64"],
)
def test_comm_ops_match_a_simulated_forward(layouts: bool, dtype: torch.dtype) -> None:
    """Every collective of the plan's execute.ir (rank 0) is one the run issues, with the same
    group and bytes (in the network's dtype), and nothing else is issued (the report prints the
    plan: no second trace)."""
    net = Network(layouts).to(dtype)
    with simulated_world(WORLD) as world, CommRecorder() as rec:
        world.replicate(net)
        parallel = AutoParallel(net)
        parallel(world.rank_map(lambda r: torch.zeros(BATCH // WORLD, 1, 28, 28, dtype=dtype)))
    plan = parallel.parallel_plan
    assert plan is not None
    text = format_plan_execute(plan, 0)
    forward = Counter({(k, g): n for (k, phase, g), n in rec.kinds().items() if phase == "forward"})
    assert plan_comm_ops(text) == forward, rec.summary() + "\n" + text
    sent = sum(r.bytes_sent for r in rec.records)
    assert f"# bytes this rank sends in one forward: {sent}" in text, text


def test_write_ir_and_dump_parallel_plan(tmp_path: Path) -> None:
    path = write_ir(tmp_path / "a", 3, "x.ir", "hello\n")
    assert path == tmp_path / "a" / "rank_3" / "x.ir"
    assert path.read_text() == "hello\n"
    assert write_ir(tmp_path / "a", 3, "x.ir", "again\n").read_text() == "again\n"
    assert write_ir(tmp_path / "a", 3, "x.ir", "last").read_text() == "last\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.ir"]  # no temporary left
    plan = planned()
    try:
        set_context(save_graphs=0, save_graphs_path=tmp_path / "g")
        assert dump_parallel_plan(plan) == []
        set_context(save_graphs=1)
        written = dump_parallel_plan(plan)  # no process group: every rank
    finally:
        set_context(save_graphs=0, save_graphs_path="./saved_graph")
    assert len(written) == 16 + 8 + 1  # two IR files and plan.html per rank; plan.png once
    assert sorted(p.name for p in (tmp_path / "g" / "rank_0").iterdir()) == [
        "execute.ir",
        "plan.html",
        "plan.png",
        "step_parallel_begin.ir",
    ]
    assert sorted(p.name for p in (tmp_path / "g" / "rank_5").iterdir()) == [
        "execute.ir",
        "plan.html",
        "step_parallel_begin.ir",
    ]
    execute = (tmp_path / "g" / "rank_5" / "execute.ir").read_text()
    assert execute == format_plan_execute(plan, 5)
    begin = (tmp_path / "g" / "rank_0" / "step_parallel_begin.ir").read_text()
    assert begin == format_plan_begin(plan)


def test_full_batch_inputs() -> None:
    """Under full_batch the input arrives whole; Flatten's rows are a local slice of it."""
    net = Network()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        plan = AutoParallel(net).dataset_strategy("full_batch").plan(shapes=SHAPES)
    text = format_plan_begin(plan)
    assert line(text, "input args[0]:") == "input args[0]: (None, None, None, None)"
    first = format_plan_execute(plan, 0).split("%1 matmul1")[0]
    assert "AllGather over g2 at matmul1" in first  # (Flatten's rows, then matmul1's columns)
    # only a primitive reads the input: it stays whole and Flatten cuts its rows out of it (a
    # local slice: no collective, no cut at entry)
    assert " at entry" not in first
    cut = [x.strip() for x in first.splitlines() if " at flatten/Flatten input 0" in x]
    assert cut == [
        "Slice(dim=0, axis=g0, 2 parts); Slice(dim=0, axis=g1, 2 parts); Slice(dim=0, axis=g2, "
        "2 parts) at flatten/Flatten input 0: StridedSlice((0, 0, 0, 0), (4, 1, 28, 28), "
        "(1, 1, 1, 1)) of local [32, 1, 28, 28] send_bytes 0"
    ]


class WithTorchOp(Network):
    """Seed 003's network with an unannotated torch op between matmul1 and relu1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul1(self.flatten(x), self.fc1_weight) * 2.0
        logits: torch.Tensor = self.matmul3(self.relu1(x), self.fc3_weight)
        return logits


def test_unannotated_torch_op_is_an_op_of_the_plan() -> None:
    """The torch op between two primitives is an op of the plan with its own placements (taken
    from DTensor's rule), after matmul1's own AllReduce."""
    text = format_plan_begin(planned(net=WithTorchOp()))
    mul = line(text, "%2 mul [torch.Tensor.mul; dtensor]: (g0, None) -> (g0, None)")
    assert mul.endswith("[32, 512]"), mul
    assert after(text, "%2 mul") == "in_strategy ((2, 1),) from dtensor; inputs [32, 512]"
    assert after(text, "%1 matmul1").startswith("in_strategy ((2, 4), (4, 1))")
    assert line(text, "comm AllReduce(sum) over g1, g2 at matmul1/MatMul")


def test_backward_section_is_what_a_train_step_runs() -> None:
    """Megatron GPT-2 at 2 x 2 (tests/parallel/test_zoo_megatron.py): the backward section of
    rank 0's execute.ir lists exactly the backward collectives a train step issues before the
    gradient buckets, in that order, with its bytes (each forward collective's adjoint:
    AllGather -> ReduceScatter, AlltoAll -> AlltoAll, AllReduce -> AllReduce); the loss's
    AllReduce has none (``loss.backward()`` seeds it on every rank), and the section says so."""
    from ..parallel.test_zoo_megatron import megatron
    from ..zoo import GPT2, token_batches

    (x, y), net = token_batches(1, 8)[0], megatron(GPT2(), 2, 2)
    with simulated_world(4) as world, CommRecorder() as rec:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a, b)[1]
            loss.backward()
            return loss

        parallel = AutoParallel(step, parallel_mode="semi_auto")
        parallel(world.rows(x), world.rows(y))
    plan = parallel.parallel_plan
    assert plan is not None
    # (a row-parallel linear's output: rows split over dp, a partial sum over mp)
    begin = [x.strip() for x in format_plan_begin(plan).splitlines()]
    row = begin.index(next(x for x in begin if x.startswith("%17 transformer.h.0.attn.c_proj")))
    assert begin[row + 1].startswith("in_strategy ((2, 1, 2), (1, 2), (1,)) from user; inputs")
    assert begin[row + 2] == "out_strategy ((2, 1, 1) partial over g1,)"
    assert "out_strategy (() partial over g0, g1,)" in begin  # (the loss, before its AllReduce)
    text = format_plan_execute(plan, 0)
    ran = [(r.kind, tuple(r.group)) for r in rec.select(phase="backward")]
    buckets = [("AllReduce", (0, 1, 2, 3)), ("AllReduce", (0, 2))]
    assert sorted(ran[-2:]) == sorted(buckets), rec.summary()
    listed = [  # (in order)
        (m.group(1), tuple(int(r) for r in m.group(2).split(", ")))
        for x in text.partition("# backward")[2].splitlines()
        if (m := re.match(r"\s+(\w+) over .* group \[([\d, ]+)\] fusion 0 send_bytes \d+$", x))
    ]
    assert listed == ran[:-2], rec.summary() + "\n" + text
    assert len(listed) == 12  # (2 layers x 3 kinds x 2)
    assert "at return 0 group [0, 1, 2, 3] fusion 0 send_bytes 6 (none when backward starts" in text
    sent = sum(r.bytes_sent for r in rec.select(phase="backward") if tuple(r.group) == (0, 1))
    assert f"# bytes this rank sends in one backward (those marked none left out): {sent}" in text
    assert line(text, "ReduceScatter over g1 at transformer.h.0.attn.c_attn") == (
        "ReduceScatter over g1 at transformer.h.0.attn.c_attn/linear input 0 group [0, 1] "
        "fusion 0 send_bytes 4096"  # (half of the gathered [4, 16, 32] float32 rows)
    )


def test_groups_of_an_interleaved_axis_pair_print_sorted() -> None:
    """A partial sum over ``("mp", "dp")`` (the later mesh axis outer): its forward AllReduce
    and the gradient's backward one name one group, printed in one order (the backward
    printed the ranks in the axes' order, [0, 2, 4, 1, 3, 5])."""
    from shardwise.layout import Layout
    from shardwise.ops import MatMul
    from shardwise.planner import plan_semi_auto

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layout = Layout((3, 2), ("dp", "mp"))
            self.w = torch.nn.Parameter(torch.randn(48, 24))
            self.mm = MatMul().shard((layout("None", ("mp", "dp")), layout(("mp", "dp"), "None")))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.mm(x, self.w)
            return out

    text = format_plan_execute(plan_semi_auto(capture(Net(), torch.zeros(24, 48)), 6), 0)
    groups = {
        line.split(" group ")[1].split(" fusion")[0]
        for line in text.splitlines()
        if "AllReduce" in line and " at mm/" in line
    }
    assert groups == {"[0, 1, 2, 3, 4, 5]"}, text
