"""A train step's backward from a root split over the ranks, under `AutoParallel`.

``out.backward(torch.ones_like(out))`` on this rank's rows seeds each rank's block once, while
the data-parallel gradient sums are divided by the group size (as for a loss, whole on every
rank: one copy per rank). The plan records the roots' placements (`ParallelPlan.roots`) and
multiplies such a seed by how many ranks one copy is spread over (`ParallelPlan.seed_scales`):
parameter gradients, input gradients and updated hsdp shards equal one device's, with the
collectives of the same step from a loss (one gradient bucket; Megatron's moves).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel, UnsupportedParallelError
from shardwise.planner import StrategyFileError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import assert_shards_match

BATCH, D_IN, HIDDEN, OUT = 12, 6, 8, 4


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def batch() -> torch.Tensor:
    return torch.randn(BATCH, D_IN, generator=torch.Generator().manual_seed(1))


def seed_of(out: torch.Tensor) -> torch.Tensor:
    """A gradient for `out` that differs by row and column (elementwise: right on blocks)."""
    return torch.cos(out.detach())


Backward = Callable[[torch.Tensor], object]
BACKWARDS: dict[str, Backward] = {
    "out.backward(ones_like)": lambda out: out.backward(torch.ones_like(out)),
    "out.backward(gradient=g)": lambda out: out.backward(gradient=seed_of(out)),
    "torch.autograd.backward([out], [g])": lambda out: torch.autograd.backward(
        [out], [seed_of(out)]
    ),
    # the second backward (retain_graph) from the same root, its seed made after the plan
    "out.backward(g, retain_graph) twice": lambda out: (
        out.backward(seed_of(out), retain_graph=True),
        out.backward(seed_of(out) * 0.5),
    ),
}


def single_device(run: Backward) -> dict[str, torch.Tensor]:
    net = make_net()
    run(net(batch()))
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def block_of(
    parallel: AutoParallel, name: str, full: torch.Tensor
) -> Callable[[int], torch.Tensor]:
    plan = parallel.parallel_plan
    assert plan is not None
    layout = plan.params[name].layout
    return lambda r: full[layout.local_index(r, tuple(full.shape))]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("how", list(BACKWARDS))
def test_data_parallel_split_root(how: str, world_size: int) -> None:
    run = BACKWARDS[how]
    want = single_device(run)
    want_out = make_net()(batch()).detach()
    net, x = make_net(), batch()

    def step(x: torch.Tensor) -> torch.Tensor:
        out = net(x)
        run(out)
        return out

    with simulated_world(world_size) as world:
        world.replicate(net)
        parallel = AutoParallel(step)
        with CommRecorder() as rec:
            out = parallel(world.rows(x))
        assert_matches_single_device(out, world.rows(want_out), what="out")
        got = {n: p.grad for n, p in net.named_parameters()}
        assert_matches_single_device(got, want, what="grads")
        backwards = 2 if "twice" in how else 1  # (one bucket per backward)
        assert rec.kinds() == Counter(
            {("AllReduce", "backward", tuple(range(world_size))): backwards}
        ), rec.summary()
        plan = parallel.parallel_plan
        assert plan is not None and plan.seed_scales() == (world_size,)
        assert f"backward from %2 (g0, None) (seed x{world_size})" in str(plan)


@pytest.mark.parametrize("shape", ["column, column", "column, row"])
def test_megatron_split_root(shape: str) -> None:
    """dp 2 x mp 2: the second Linear column parallel leaves the output split over both axes
    (seed x4); row parallel makes it whole over mp (its AllReduce), split over dp only (x2)."""
    want = single_device(BACKWARDS["out.backward(gradient=g)"])
    net = make_net()
    sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
    second = ((2, 1), (2, 1)) if shape == "column, column" else ((2, 2), (1, 2))
    sw.shard(net[2], in_strategy=second)
    x = batch()

    def step(x: torch.Tensor) -> torch.Tensor:
        out = net(x)
        out.backward(gradient=seed_of(out))
        return out

    with simulated_world(4) as world:
        world.replicate(net)
        parallel = AutoParallel(step)
        with CommRecorder() as rec:
            parallel(world.rows(x))
        for name, p in net.named_parameters():
            assert_matches_single_device(
                p.grad, block_of(parallel, name, want[name]), what=f"{name}.grad"
            )
        plan = parallel.parallel_plan
        assert plan is not None
        assert plan.seed_scales() == ((4,) if shape == "column, column" else (2,))
        dp, mp = (0, 2), (0, 1)
        kinds = (
            {("AllGather", "forward", mp): 2, ("AlltoAll", "forward", mp): 1}
            | {("ReduceScatter", "backward", mp): 1, ("AllReduce", "backward", dp): 1}
            if shape == "column, column"
            else {("AllGather", "forward", mp): 1, ("AllReduce", "forward", mp): 1}
            | {("AllReduce", "backward", mp): 1, ("AllReduce", "backward", dp): 1}
            | {("AllReduce", "backward", (0, 1, 2, 3)): 1}
        )
        assert rec.kinds() == Counter(kinds), rec.summary()


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_hsdp_split_root_updates_like_one_device(level: str) -> None:
    """Optimizer parallel on 2 ranks, every parameter a 1/2 shard: after one SGD step from a
    split root's backward, each rank's shard equals its rows of one device's parameter."""
    ref = make_net()
    out = ref(batch())
    out.backward(seed_of(out))
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    net, x = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor) -> torch.Tensor:
            out = net(x)
            out.backward(seed_of(out))
            opt.step()
            opt.zero_grad()
            return out

        parallel = AutoParallel(step).hsdp(threshold=0, optimizer_level=level)
        parallel(world.rows(x))
        assert_shards_match(parallel, net, {n: p.detach() for n, p in ref.named_parameters()})


def test_input_gradient_from_a_split_root() -> None:
    """``torch.autograd.grad(out, x, grad_outputs=g)`` as the step's last differentiation:
    each rank gets its rows of one device's input gradient."""
    x = batch().requires_grad_()
    ref = make_net()
    out = ref(x)
    (want,) = torch.autograd.grad(out, x, grad_outputs=seed_of(out))
    net, batch_x = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            out = net(x)
            (g,) = torch.autograd.grad(out, x, grad_outputs=seed_of(out))
            return g

        got = AutoParallel(step)(world.rows(batch_x).requires_grad_())
        assert_matches_single_device(got, world.rows(want), what="input grad")


def test_plan_roots_round_trip() -> None:
    """The roots are part of the plan: saved, loaded equal, and a changed one is a diff."""
    import dataclasses

    from shardwise.planner import ParallelPlan

    net = make_net()

    def step(x: torch.Tensor) -> torch.Tensor:
        out = net(x)
        out.backward(torch.ones_like(out))
        return out

    x = batch()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = AutoParallel(step)
        parallel(world.rows(x))
        plan = parallel.parallel_plan
    assert plan is not None
    loaded = ParallelPlan.from_dict(plan.to_dict())
    assert loaded == plan and loaded.roots == plan.roots and plan.roots
    other = dataclasses.replace(plan, roots=())
    assert any("backward roots" in line for line in plan.diff(other))


def test_gpt2_logits_backward_with_a_gradient() -> None:
    """nanoGPT's GPT-2 (plain torch, `tests/zoo.py`) on 2 data-parallel ranks, its logits'
    backward seeded with a gradient: every parameter gradient equals one device's."""
    from ..zoo import GPT2, GPT2Config, token_batches

    config = GPT2Config(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    ((x, _),) = token_batches(1, 4)
    ref = GPT2(config)
    logits, _ = ref(x)
    logits.backward(seed_of(logits))
    want = {n: p.grad for n, p in ref.named_parameters()}
    net = GPT2(config)
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            logits, _ = net(x)
            logits.backward(seed_of(logits))
            return logits

        AutoParallel(step)(world.rows(x))
        got = {n: p.grad for n, p in net.named_parameters()}
        assert_matches_single_device(got, want, what="grads")


def test_gradient_accumulation_with_a_seed_made_outside_the_plan() -> None:
    """Two passes of the plan in one call, each backward from its own output: the second
    pass's seed takes an op the plan does not have (``* 0.7``, run outside it), and its root,
    the same node's output, is still scaled (it was not: pass 1 came out 1/N)."""
    xa, xb = batch(), batch() * 0.5 + 1
    ref = make_net()
    out = ref(xa)
    out.backward(seed_of(out))
    out = ref(xb)
    out.backward(seed_of(out) * 0.7)
    want = {n: p.grad for n, p in ref.named_parameters()}
    net = make_net()

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = net(a)
        out.backward(seed_of(out))
        out = net(b)
        out.backward(seed_of(out) * 0.7)
        return out

    with simulated_world(2) as world:
        world.replicate(net)
        AutoParallel(step)(world.rows(xa), world.rows(xb))
        assert_matches_single_device({n: p.grad for n, p in net.named_parameters()}, want)


def test_a_later_backward_from_another_split_tensor_is_refused() -> None:
    """The first backward starts from a slice of the output, a second (through the retained
    graph) from the output itself, which the plan does not know as a root: refused, naming the
    fix (it came out as grad(v) + grad(out) / N, silently)."""
    net, x = make_net(), batch()

    def step(a: torch.Tensor) -> torch.Tensor:
        out = net(a)
        v = out[:, :2]
        v.backward(seed_of(v), retain_graph=True)
        out.backward(seed_of(out))
        return out

    with simulated_world(2) as world:
        world.replicate(net)
        with pytest.raises(UnsupportedParallelError, match=r"local shape \[6, 4\].*0-d loss"):
            AutoParallel(step)(world.rows(x))


def test_strategy_files_and_backward_roots(tmp_path: Path) -> None:
    """An operator strategy file without roots (saved before plans kept them) runs with this
    step's; one whose step started its backward elsewhere (its ops the same) is a
    `StrategyFileError` (both ran the file's roots: 1/N gradients, silently)."""
    x = batch()
    ref = make_net()
    out = ref(x)
    out.backward(seed_of(out))
    want = {n: p.grad for n, p in ref.named_parameters()}

    def step_of(net: nn.Module, from_loss: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(a: torch.Tensor) -> torch.Tensor:  # (the same ops, another root)
            out = net(a)
            g = seed_of(out)
            loss = (out * g).sum()
            if from_loss:
                loss.backward()
            else:
                out.backward(g)
            return out

        return step

    for name, from_loss in (("split.json", False), ("loss.json", True)):
        net = make_net()
        with simulated_world(2) as world:
            world.replicate(net)
            saving = AutoParallel(step_of(net, from_loss))
            saving(world.rows(x))
            saving.save_operator_strategy_file(tmp_path / name)
    data = json.loads((tmp_path / "split.json").read_text())
    del data["roots"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)
        loaded = AutoParallel(step_of(net, False)).load_operator_strategy_file(
            tmp_path / "old.json"
        )
        loaded(world.rows(x))
        assert_matches_single_device({n: p.grad for n, p in net.named_parameters()}, want)
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)
        other = AutoParallel(step_of(net, False)).load_operator_strategy_file(
            tmp_path / "loss.json"
        )
        with pytest.raises(StrategyFileError, match=r"backward starts from %\d+ \(\) \(seed x1\)"):
            other(world.rows(x))


def test_a_primitive_networks_output_as_root() -> None:
    """Seed 003's network of shardwise primitives on 8 ranks, its logits' backward seeded with a
    gradient: the root is a primitive's output (noted by its module hook), and every gradient
    block equals one device's (it was refused: the root was not noted)."""
    from .test_seed003_parity import Network, blocks, data

    (x, _), *_ = data()
    rows = x.shape[0]  # (the seed of a mean over the batch: gradients of a loss's size)
    ref = Network()
    out = ref(x)
    out.backward(seed_of(out) / rows)
    want = {n: p.grad for n, p in ref.named_parameters()}
    net = Network()
    with simulated_world(8) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            logits = net(a)
            logits.backward(seed_of(logits) / rows)
            return logits

        parallel = AutoParallel(step)
        parallel(world.rows(x))
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in net.named_parameters():
            layout = plan.params[name].layout
            assert_matches_single_device(p.grad, blocks(want[name], layout), what=name)


class _Monitored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)  # (rows split by 3: hsdp shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h = torch.tanh(self.fc1(x))
        out: torch.Tensor = self.fc2(self.h)
        return out


def test_a_monitoring_grad_from_a_split_root_before_the_loss() -> None:
    """A ``torch.autograd.grad(out, h, ones, retain_graph=True)`` from this rank's rows of the
    output, before the loss's backward: its root is not one the plan knows (the capture's
    backward starts at the loss), so it is run as given (each rank its rows of one device's
    gradient), not refused; the loss's backward then gives one device's gradients."""
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(12, 6, generator=g), torch.randn(12, 6, generator=g)

    def body(net: _Monitored, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = net(x)
        ones = torch.ones_like(out)
        gh, gx = torch.autograd.grad(out, [net.h, x], ones, retain_graph=True)
        F.mse_loss(out, t).backward()
        return gh, gx

    one = _Monitored()
    want = body(one, x.clone().requires_grad_(), t)
    net = _Monitored()
    with simulated_world(3) as world:
        world.replicate(net)
        step = sw.AutoParallel(lambda a, b: body(net, a, b))
        got = step(world.rows(x).requires_grad_(), world.rows(t))
        for g, w, what in zip(got, want, ["hidden", "input"], strict=True):
            assert_matches_single_device(g, world.rows(w), what=f"monitored {what} gradient")
        for p, q in zip(net.parameters(), one.parameters(), strict=True):
            assert_matches_single_device(p.grad, q.grad, what="gradient")


@pytest.mark.parametrize("level", ["buckets", "level1", "level2"])
@pytest.mark.parametrize("order", ["monitor_after", "half_then_float"])
def test_backward_calls_with_other_divisors_in_one_step(order: str, level: str) -> None:
    """Two differentiations in one step whose gradients are divided differently (a float16
    loss on 3 ranks keeps its seed and is divided by 3; a float32 loss is seeded with 1/3; a
    monitoring grad after the loss's backward): hsdp level 1 holds the gradients on its leaves
    until the optimizer's step and divided them all by the last backward's divisor (0.03 and
    0.09 off one device); each backward's gradients are now divided as that backward says."""
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(12, 6, generator=g), torch.randn(12, 6, generator=g)

    def body(
        net: _Monitored, opt: torch.optim.Optimizer, x: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        out = net(x)
        loss = F.mse_loss(out, t)
        if order == "monitor_after":
            loss.backward(retain_graph=True)
            torch.autograd.grad(out, net.h, torch.ones_like(out), retain_graph=True)
        else:
            F.mse_loss(out, t).half().backward(retain_graph=True)
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    one = _Monitored()
    body(one, torch.optim.SGD(one.parameters(), lr=1.0), x, t)
    net = _Monitored()
    with simulated_world(3) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        step = sw.AutoParallel(lambda a, b: body(net, opt, a, b))
        if level != "buckets":
            step = step.hsdp(threshold=0, optimizer_level=level)
        step(world.rows(x), world.rows(t))
        assert_shards_match(step, net, {n: q.detach() for n, q in one.named_parameters()})
