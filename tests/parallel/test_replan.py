"""Networks whose ops change between calls get one plan per variant.

A plan is captured from one call. When a later call runs other ops before its first backward
(a branch on a Python flag), or passes inputs of other global shapes, `AutoParallel` captures and
plans that call too (the parameters stay stored as the first plan stores them) and keeps both:
a variant seen before reuses its plan. Each step equals one device's (loss and parameters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.context import set_context
from shardwise.parallel import UnsupportedParallelError
from shardwise.report import format_plan_begin, format_plan_execute
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

WORLD = 4


class Branchy(nn.Module):
    """An MLP whose middle layer runs only when `deep` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.mid, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.deep = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.deep:
            h = torch.tanh(self.mid(h))
        out: torch.Tensor = self.fc2(h)
        return out


SCHEDULE = [(False, 8), (True, 8), (False, 8), (True, 16), (False, 8)]  # (deep, global batch)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
        for _, n in SCHEDULE
    ]


def test_branches_and_batch_sizes_get_their_own_plans() -> None:
    data = batches()
    ref = Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for (deep, _), (x, y) in zip(SCHEDULE, data, strict=True):
        ref.deep = deep
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append((loss.detach(), {n: p.detach().clone() for n, p in ref.named_parameters()}))

    net = Branchy()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        popt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            popt.step()
            popt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step)
        plans = []
        for s, ((deep, _), (x, y)) in enumerate(zip(SCHEDULE, data, strict=True)):
            net.deep = deep
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s][0], what=f"loss {s}")
            for name, p in net.named_parameters():
                assert_matches_single_device(p.detach(), want[s][1][name], what=f"{s} {name}")
            plans.append(parallel.parallel_plan)
    ops = [len(p.nodes) if p is not None else 0 for p in plans]
    assert ops[0] == ops[2] == ops[4] < ops[1] == ops[3]
    assert plans[2] is plans[0] and plans[4] is plans[0]  # a variant seen before: its plan
    assert plans[3] is not plans[1]  # (another batch size)
    assert plans[3] is not None and plans[3].input_shapes["args[0]"] == (16, 8)


def test_ops_that_change_after_backward_are_an_error() -> None:
    """Two forwards in one step (gradient accumulation) must run the same ops: the second one
    changing after a backward cannot be planned again mid-step. The error says it is a later
    pass of the call that differs from its first (each step ran the same ops: "every step" was
    wrong) and names the fixes."""
    net = Branchy()
    match = r"after a backward inside this call; every later pass of a call .* same torch ops "
    match += r".*in the same order as its first pass .* once per micro-batch"
    second_pass_raises(net, net, "deep", match)


def second_pass_raises(net: nn.Module, called: nn.Module, flag: str, match: str) -> None:
    """A step calling `called` (holding `net`) twice, with `called.<flag>` False, then True
    (other ops in the second pass): an `UnsupportedParallelError` matching `match`."""
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            setattr(called, flag, False)
            F.cross_entropy(called(a), b).backward()
            setattr(called, flag, True)
            loss = F.cross_entropy(called(a), b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        with pytest.raises(UnsupportedParallelError, match=match):
            parallel(world.rows(x), world.rows(y))


@pytest.mark.parametrize("centred", [False, True])
def test_a_later_pass_starts_where_the_network_was_entered(centred: bool) -> None:
    """A step whose first op comes before the network (``total = torch.zeros(())``) and that
    then runs two micro-batches: the second forward starts again where its ops start (it was
    run unplanned before: each rank's own loss, silently): at the network, or at the
    per-micro-batch ``x - x.mean(0)`` before it (a mean over the rows of all ranks: one more
    AllReduce per micro-batch). The summed loss and the gradients equal one device's."""
    data = batches()
    (x1, y1), (x2, y2) = data[0], data[2]
    x2 = x2 + torch.arange(8.0)[:, None]  # (the ranks' rows have other means)

    def make_step(net: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(*xy: torch.Tensor) -> torch.Tensor:
            total = torch.zeros(())
            for x, y in (xy[:2], xy[2:]):
                if centred:
                    x = x - x.mean(0, keepdim=True)
                loss = F.cross_entropy(net(x), y) / 2
                loss.backward()
                total = total + loss.detach()
            opt.step()
            opt.zero_grad()
            return total

        return step

    ref = Branchy()
    want = make_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1))(x1, y1, x2, y2)
    net = Branchy()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(make_step(net, torch.optim.SGD(net.parameters(), lr=0.1)))
        with CommRecorder() as rec:
            loss = parallel(*(world.rows(t) for t in (x1, y1, x2, y2)))
        assert_matches_single_device(loss, want, what="loss")
        for name, p in net.named_parameters():
            got, full = p.detach(), dict(ref.named_parameters())[name].detach()
            assert_matches_single_device(got, full, what=name)
        plan = parallel.parallel_plan
        assert plan is not None and plan.nodes[0].op == "torch.zeros"
        ranks = tuple(range(WORLD))
        means = 2 if centred else 0
        assert rec.count(kind="AllReduce", phase="forward") == 2 + means, rec.summary()
        assert rec.kinds()[("AllReduce", "backward", ranks)] == 2  # (the buckets)


def test_a_network_entered_again_with_other_first_ops_is_an_error() -> None:
    """The network called again after backward, but starting with another op than the plan's
    first pass did: an error naming the op and the plan's, never an unplanned computation."""
    net = Branchy()

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.scale = net, False

        def forward(self, a: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.inner(a * 2.0 if self.scale else a)
            return out

    second_pass_raises(net, Scaled(), "scale", r"called again .*first op .*mul")


def test_a_pass_reading_a_tensor_made_outside_the_plan_is_an_error() -> None:
    """After a backward, an op the plan does not have (``x - x.mean(0)``: the first pass had
    none) runs outside the plan, on this rank's rows only (the mean of its own rows); the
    network then starting a pass from its result is refused, naming the op and the node.
    An elementwise op there (``x * 0.5``) is right on the rows and allowed:
    `test_grad_buckets.test_accumulating_backward_calls`."""
    net, x, y = Branchy(), torch.randn(8, 8), torch.randint(0, 3, (8,))
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            total = torch.zeros(())
            F.cross_entropy(net(a), b).backward()
            loss = F.cross_entropy(net(a - a.mean(0, keepdim=True)), b)
            loss.backward()
            return total + loss.detach()

        parallel = sw.AutoParallel(step)
        match = r"linear \(a new pass\) reads a tensor that an op the plan does not have made"
        with pytest.raises(UnsupportedParallelError, match=match):
            parallel(world.rows(x), world.rows(y))


class NormBranch(nn.Module):
    """BatchNorm (running statistics: state the forward changes), then a flag branch, then an
    extra op appended at the end when `tail` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.fc, self.bn, self.mid = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)
        self.deep, self.tail = False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        if self.deep:
            h = self.mid(h)
        return h.softmax(0) if self.tail else h


def test_a_stopped_attempt_leaves_no_trace_and_tail_ops_are_planned() -> None:
    """A call that stops on a new branch is run again from the start: the BatchNorm statistics
    its first attempt updated are put back (running mean and batch count equal one device's).
    An op appended after the plan's last op (softmax over the batch) is planned too, not run on
    each rank's rows."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 8, generator=g) for _ in range(3)]
    flags = [(False, False), (True, False), (True, True)]
    ref = NormBranch()
    want = []
    for (deep, tail), x in zip(flags, xs, strict=True):
        ref.deep, ref.tail = deep, tail
        want.append(ref(x).detach())
    net = NormBranch()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        for s, ((deep, tail), x) in enumerate(zip(flags, xs, strict=True)):
            net.deep, net.tail = deep, tail
            got = parallel(world.rows(x))
            n = 8 // WORLD
            assert_matches_single_device(
                got, lambda r, w=want[s], n=n: w[r * n : (r + 1) * n], what=f"call {s}"
            )
        assert_matches_single_device(net.bn.running_mean, ref.bn.running_mean, what="mean")
        assert_matches_single_device(net.bn.running_var, ref.bn.running_var, what="var")
        assert int(world.local(net.bn.num_batches_tracked, 0)) == 3


def test_each_plan_made_again_gets_its_own_ir_files(tmp_path: Path) -> None:
    """With ``save_graphs``, the first plan goes to ``step_parallel_begin.ir`` / ``execute.ir``
    and the k-th plan made again to ``step_parallel_begin_<k>.ir`` / ``execute_<k>.ir``, each
    with its gradient buckets."""
    net = Branchy()
    xs = {rows: torch.randn(rows, 8) for rows in (8, 16)}
    try:
        set_context(save_graphs=1, save_graphs_path=tmp_path)
        with simulated_world(WORLD) as world:
            world.replicate(net)
            parallel = sw.AutoParallel(net)
            plans = []
            for deep, rows in [(False, 8), (True, 8), (False, 8), (True, 16)]:
                net.deep = deep
                parallel(world.rows(xs[rows]))
                plans.append(parallel.parallel_plan)
    finally:
        set_context(save_graphs=0, save_graphs_path="./saved_graph")
    names = sorted(p.name for p in (tmp_path / "rank_0").iterdir())
    assert names == [
        "execute.ir",
        "execute_1.ir",
        "execute_2.ir",
        "plan.html",
        "plan.png",
        "plan_1.html",
        "plan_1.png",
        "plan_2.html",
        "plan_2.png",
        "step_parallel_begin.ir",
        "step_parallel_begin_1.ir",
        "step_parallel_begin_2.ir",
    ]
    for k, plan in [(0, plans[0]), (1, plans[1]), (2, plans[3])]:
        assert plan is not None
        suffix = f"_{k}" if k else ""
        begin = (tmp_path / "rank_3" / f"step_parallel_begin{suffix}.ir").read_text()
        assert begin == format_plan_begin(plan)
        execute = (tmp_path / "rank_3" / f"execute{suffix}.ir").read_text()
        assert execute.startswith(format_plan_execute(plan, 3))
        assert "# gradient buckets (no optimizer parallel)" in execute  # (each variant's too)


def _two_micro_batches(body: Any) -> None:
    """`body(net, opt)`'s step on `batches()[0]` with the Python numbers 0.5, then 0.8, on one
    device and under `AutoParallel` on `WORLD` simulated ranks: the loss and every parameter
    after each call equal."""
    x, y = batches()[0]
    ref, net = Branchy(), Branchy()
    ref_step = body(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(body(net, torch.optim.SGD(net.parameters(), lr=0.1)))
        for number in (0.5, 0.8):
            want = ref_step(x, y, number)
            got = parallel(world.rows(x), world.rows(y), number)
            assert_matches_single_device(got, want, what=f"loss ({number})")
            for name, p in net.named_parameters():
                full = dict(ref.named_parameters())[name].detach()
                assert_matches_single_device(p.detach(), full, what=f"{name} ({number})")


def test_python_numbers_of_each_pass_and_call_are_used() -> None:
    """A Python weight that changes between passes and between calls scales the whole loss
    with this pass's value (ops on whole values once ran with the numbers captured at the first
    call: 0.5 in every call, silently), and a step whose micro-batches are chunks of its batch
    starts each pass at the network."""

    def body(net: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor, first: float) -> torch.Tensor:
            total = torch.zeros(())
            for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
                loss = F.cross_entropy(net(xm), ym) * (first if i == 0 else 1 - first / 2)
                loss.backward()
                total = total + loss
            opt.step()
            opt.zero_grad()
            return total

        return step

    _two_micro_batches(body)


def test_slice_bounds_from_a_local_shape_that_change_between_passes_are_an_error() -> None:
    """``n = x.shape[0] // 2`` reads this rank's rows; the plan slices the whole batch, so the
    captured bounds serve the first pass, and a later pass changing them is refused (it cannot
    be told what they mean), naming the op."""

    def body(net: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
            n = x.shape[0] // 2
            for i in range(2):
                part = slice(i * n, (i + 1) * n)
                (F.cross_entropy(net(x[part]), y[part]) * scale).backward()
            opt.step()
            return torch.zeros(())

        return step

    with pytest.raises(
        UnsupportedParallelError, match=r"__getitem__ .* split tensor's local shape"
    ):
        _two_micro_batches(body)


def test_an_op_after_backward_like_a_passs_first_does_not_start_it() -> None:
    """Each micro-batch starts with ``x + x`` (an add of the step's inputs); the logging line
    ``total = total + loss.detach()`` after its backward is an add too, of values made in the
    step: it must not start a pass there (it did: then "called add where the plan has linear")."""

    def body(net: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
            total = torch.zeros(())
            for _ in range(2):
                loss = F.cross_entropy(net(x + x), y) * weight
                loss.backward()
                total = total + loss.detach()
            opt.step()
            opt.zero_grad()
            return total

        return step

    _two_micro_batches(body)


def test_a_factory_after_the_last_backward_starts_no_pass() -> None:
    """``torch.zeros(())`` after the micro-batches (a logging accumulator) looks like the plan's
    first op (``total = torch.zeros(())``); the op after it is not the plan's next, so no pass
    had started: both run outside the plan (it was: "called linalg.vector_norm where the plan
    has fc1/linear")."""

    def body(net: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
            total = torch.zeros(())
            for _ in range(2):
                loss = F.cross_entropy(net(x), y) * weight
                loss.backward()
                total = total + loss.detach()
            log = torch.zeros(())
            log = log + torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
            opt.step()
            opt.zero_grad()
            return total + 0 * log

        return step

    _two_micro_batches(body)


class FactoryFirst(nn.Module):
    """A network whose forward starts with a factory (``torch.ones``, as nanoGPT's positions
    start with ``torch.arange``); `odd` adds an op right after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc, self.odd = nn.Linear(8, 3), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(8)
        if self.odd:
            x = x.abs()
        out: torch.Tensor = self.fc(x * scale)
        return out


def test_a_pass_the_network_started_with_a_factory_still_refuses_other_ops() -> None:
    """The second micro-batch enters the network, starts the pass with its factory, then runs
    an op the plan does not have there: an error naming both ops (it is the network's pass,
    not a logging factory to drop and run outside the plan)."""
    net = FactoryFirst()
    second_pass_raises(net, net, "odd", r"called torch.Tensor.abs where")


def test_a_flag_picks_the_plan_its_last_call_ran() -> None:
    """A step that evaluates under ``train=False`` and trains otherwise, its loss scaled after
    the forward (nanoGPT's ``(loss / accum).backward()``): each call started with the plan the
    last call ran, so every train call after an eval one stopped at the scaling (the eval
    plan's end) and ran its whole forward again: twice the forward's collectives, and at hsdp
    level 3 a leak of the stopped forward. A call starts with the plan of its flags now."""
    data = batches()
    net = Branchy()
    sw.shard(net.fc1, in_strategy=((1, 1), (WORLD, 1)))  # (column parallel: forward collectives)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
            if not train:
                with torch.no_grad():
                    return F.cross_entropy(net(x), y)
            loss = F.cross_entropy(net(x), y)
            (loss / 2).backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step)
        counts = []
        for x, y in [data[0], data[2], data[4]]:
            with CommRecorder() as rec:
                parallel(world.rows(x), world.rows(y))
            counts.append(rec.kinds())
            parallel(world.rows(x), world.rows(y), train=False)
    assert counts[0] == counts[1] == counts[2], [sum(c.values()) for c in counts]


def test_a_flag_picks_no_plan_replaced_since() -> None:
    """A plan noted for a flag, then replaced (a weight frozen: other gradient buckets): the
    flag's next call runs the plan kept now, whose buckets leave the frozen weight out (it ran
    the replaced one: the plan the wrapper reported still bucketed the frozen weight)."""
    data = batches()
    net = Branchy()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            if train:
                loss.backward()
                opt.step()
                opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step)
        x, y = data[0]
        parallel(world.rows(x), world.rows(y))
        parallel(world.rows(x), world.rows(y), train=False)
        net.fc2.weight.requires_grad_(False)
        parallel(world.rows(x), world.rows(y))
        parallel(world.rows(x), world.rows(y), train=False)
        plan = parallel.parallel_plan
        assert plan is not None
        assert not any("fc2.weight" in b.params for b in plan.buckets), plan.buckets
