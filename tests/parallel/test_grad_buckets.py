"""Bucketed gradient AllReduces of semi_auto without hsdp (`_grad_buckets.GradBuckets`), 4 simulated
ranks, in both runtimes: the plan executor (`_graph_run`: a plain-torch network, default
buckets) and the primitive runtime (`_call`: taken with ``comm_fusion``).

A plain-torch MLP (every parameter replicated on all ranks: one AllReduce group) wrapped with
its train step: by default (25 MB buckets) each backward issues exactly ONE gradient AllReduce;
with ``comm_fusion({"allreduce": {"mode": "size", ...}})`` of 4 KB, five, filled in reverse
parameter order and started as soon as they are full (before the first layer's gradient
exists). In every case the loss and the gradients equal one device's, also with two backward
calls per step (accumulating, onto a gradient left as zeros too), with ``torch.autograd.grad``
(returned, nothing stored), with a layer that gets no gradient, after a backward that raised,
and with a float64 parameter (its own bucket: one dtype per flat buffer). The gradients are
views of the bucket's buffer: gradients a caller keeps are not overwritten by the next backward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.communication import recorder
from shardwise.parallel import AutoParallel
from shardwise.testing import (
    CommRecorder,
    SimulatedWorld,
    assert_matches_single_device,
    simulated_world,
)

WORLD, BATCH = 4, 8
RANKS = tuple(range(WORLD))
SMALL = {"allreduce": {"mode": "size", "config": 4 / 1024}}  # 4 KB buckets


class Mlp(nn.Module):
    """16 -> 32 -> 32 -> 4; `spare` is used only when `use_spare` (float32 parameters: l1.weight
    2 KB, l2.weight 4 KB, head.weight 512 B, biases 128 / 128 / 16 B); `scale`: an optional
    float64 parameter."""

    def __init__(self, scale: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 32)
        self.spare, self.head = nn.Linear(32, 32), nn.Linear(32, 4)
        self.use_spare = True
        self.scale = nn.Parameter(torch.full((4,), 1.5, dtype=torch.float64)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l2(torch.relu(self.l1(x))))
        if self.use_spare:
            h = h + self.spare(h)
        out: torch.Tensor = self.head(h)
        return out if self.scale is None else out * self.scale.float()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def grads(net: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in net.named_parameters()}


def single_device(
    run: Callable[[nn.Module, torch.Tensor, torch.Tensor], Any], use_spare: bool = True
) -> tuple[Any, dict[str, torch.Tensor | None]]:
    net = Mlp()
    net.use_spare = use_spare
    x, y = batch()
    return run(net, x, y), grads(net)


def wrapped(
    world: SimulatedWorld, net: Mlp, run: Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]
) -> AutoParallel:
    """`net` replicated in `world`, its train step `run(net, x, y)` wrapped."""
    world.replicate(net)

    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        return run(net, x, y)

    return AutoParallel(step)


def backward_once(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    return loss


def expect(grad_allreduces: int) -> Counter[tuple[str, str, tuple[int, ...]]]:
    """The loss's forward AllReduce (its backward needs none: ``loss.backward()``) and the
    gradient AllReduces."""
    return Counter(
        {
            ("AllReduce", "forward", RANKS): 1,
            ("AllReduce", "backward", RANKS): grad_allreduces,
        }
    )


@pytest.mark.parametrize(
    ("fusion", "buckets"),
    [
        (None, [("head.bias", "head.weight", "spare.bias", "spare.weight", "l2.bias",
                 "l2.weight", "l1.bias", "l1.weight")]),
        (SMALL, [("head.bias", "head.weight", "spare.bias"), ("spare.weight",), ("l2.bias",),
                 ("l2.weight",), ("l1.bias", "l1.weight")]),
    ],
    ids=["default-25MB", "size-4KB"],
)  # fmt: skip
def test_one_allreduce_per_bucket(fusion: dict[str, Any] | None, buckets: list[Any]) -> None:
    """Each bucket is one AllReduce; the 4 KB buckets start as soon as they are full: the first
    two before the first layer's gradient exists (a hook of l1.weight that runs before
    shardwise's marks the moment), the one holding l1.weight after."""
    want_loss, want = single_device(backward_once)
    net = Mlp()
    x, y = batch()  # (made outside the world: plain tensors)
    with simulated_world(WORLD) as world:
        parallel = wrapped(world, net, backward_once)
        if fusion is not None:
            parallel.comm_fusion(fusion)
        net.l1.weight.register_hook(lambda g: recorder.mark("l1.weight gradient"))
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert rec.kinds() == expect(len(buckets)), rec.summary()
        assert_matches_single_device(loss, want_loss, what="loss")
        assert_matches_single_device(grads(net), want, what="grads")
    plan = parallel.optimizer_plan
    assert plan is not None and [b.names for b in plan.buckets] == buckets
    assert not any(p.sharded for p in plan.params)
    (mark,) = [t for name, t in rec.marks if name == "l1.weight gradient"]
    started = {r.label.split(" (")[0]: r.end - r.seconds for r in rec.select(phase="backward")}
    last = f"bucket {len(buckets) - 1}"
    assert all(t < mark for b, t in started.items() if b != last), (started, mark)
    assert started[last] > mark, (started, mark)


def test_accumulating_backward_calls() -> None:
    """Two backward calls per step (the second's gradients added to the first's), then a step
    whose ``.grad`` tensors were left as zeros (``zero_grad(set_to_none=False)``): one bucket
    AllReduce per backward, the gradients of one device."""

    def twice(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = backward_once(net, x, y)
        F.cross_entropy(net(x * 0.5), y).backward()
        return loss

    want_loss, want = single_device(twice)
    net = Mlp()
    x, y = batch()  # (made outside the world: plain tensors)
    with simulated_world(WORLD) as world:
        parallel = wrapped(world, net, twice)
        for _ in range(2):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            assert rec.count("AllReduce", "backward") == 2, rec.summary()  # one per backward
            assert_matches_single_device(loss, want_loss, what="loss")
            assert_matches_single_device(grads(net), want, what="grads")
            net.zero_grad(set_to_none=False)


def test_autograd_grad_returns_reduced_gradients() -> None:
    """``torch.autograd.grad`` (a wrapped network, the loss of this rank's rows taken outside:
    the gradient of the global mean): the reduced gradients are returned (views of the bucket's
    flat buffer, filled at the end of backward), ``.grad`` stays None, one AllReduce."""

    def returned(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))

    want, _ = single_device(returned)
    net = Mlp()
    x, y = batch()  # (made outside the world: plain tensors)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        with CommRecorder() as rec:
            got = returned(parallel, world.rows(x), world.rows(y))
        assert rec.kinds() == Counter({("AllReduce", "backward", RANKS): 1}), rec.summary()
        assert_matches_single_device(list(got), list(want), what="grads")
        assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize(("fusion", "allreduces"), [(None, 1), (SMALL, 4)])
def test_parameters_without_gradient(fusion: dict[str, Any] | None, allreduces: int) -> None:
    """`spare` unused: its ``.grad`` stays None, as on one device. A bucket holding a spare
    parameter and others starts at the end of backward, zeros in the spare's slot (every rank
    runs the same graph); a bucket of spare parameters only (4 KB: ``spare.weight`` alone) is
    skipped: 4 AllReduces for 5 buckets."""
    want_loss, want = single_device(backward_once, use_spare=False)
    net = Mlp()
    net.use_spare = False
    x, y = batch()  # (made outside the world: plain tensors)
    with simulated_world(WORLD) as world:
        parallel = wrapped(world, net, backward_once)
        if fusion is not None:
            parallel.comm_fusion(fusion)
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert rec.kinds() == expect(allreduces), rec.summary()
        assert_matches_single_device(loss, want_loss, what="loss")
        assert net.spare.weight.grad is None and net.spare.bias.grad is None
        used = {n: g for n, g in grads(net).items() if not n.startswith("spare")}
        assert_matches_single_device(used, {n: want[n] for n in used}, what="grads")


def test_backward_that_raised_is_dropped() -> None:
    """A backward that raises after some buckets started (a hook on the input's gradient): the
    next forward drops it; the next backward's gradients equal one device's."""
    _, want = single_device(backward_once)
    net = Mlp()

    def boom(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    x, y = batch()  # (made outside the world: plain tensors)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net).comm_fusion(SMALL)
        failing = world.rows(x).clone().requires_grad_(True)
        failing.register_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            F.cross_entropy(parallel(failing), world.rows(y)).backward()
        net.zero_grad(set_to_none=True)
        out = parallel(world.rows(x))  # (drops the failed backward: its started AllReduces end)
        with CommRecorder() as rec:
            F.cross_entropy(out, world.rows(y)).backward()
        # (the loss of this rank's rows, outside the wrapper: the gradient of their mean over
        # the ranks, the global mean's)
        assert rec.count("AllReduce", "backward") == 5, rec.summary()  # the 5 buckets
        assert_matches_single_device(grads(net), want, what="grads")


def test_float64_parameter_gets_its_own_bucket() -> None:
    """Buckets hold one dtype: the float64 `scale` is reduced in a bucket of its own."""

    def make() -> Mlp:
        return Mlp(scale=True)

    ref = make()
    x, y = batch()
    backward_once(ref, x, y)
    net = make()
    with simulated_world(WORLD) as world:
        parallel = wrapped(world, net, backward_once)
        with CommRecorder() as rec:
            parallel(world.rows(x), world.rows(y))
        assert rec.kinds() == expect(2), rec.summary()
        dtypes = [r.dtype for r in rec.select(phase="backward")]
        assert sorted(map(str, dtypes)) == ["torch.float32", "torch.float64"]
        assert_matches_single_device(grads(net), grads(ref), what="grads")


def test_kept_gradients_are_not_overwritten() -> None:
    """The reduced gradients are slots of the bucket's flat buffer, which the next backward
    reuses once they are dropped; gradients the caller still holds keep their values (that
    backward takes a new buffer), and each step's gradients are one device's."""

    def doubled(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return backward_once(net, x * 2, y)

    _, want = single_device(backward_once)
    _, want_doubled = single_device(doubled)
    net = Mlp()
    x, y = batch()  # (made outside the world: plain tensors)
    x2 = x * 2
    with simulated_world(WORLD) as world:
        parallel = wrapped(world, net, backward_once)
        parallel(world.rows(x), world.rows(y))
        kept = grads(net)  # (held across the next backward)
        net.zero_grad()
        parallel(world.rows(x2), world.rows(y))
        assert_matches_single_device(kept, want, what="kept grads")
        assert_matches_single_device(grads(net), want_doubled, what="grads")
        del kept
        net.zero_grad()
        parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(grads(net), want, what="grads")


def test_a_backward_after_one_that_raised_without_a_forward_between() -> None:
    """Two forwards, then a backward that raises and one that does not: the second backward's
    gradients are not added to the failed one's buckets (nothing would deliver them: each
    rank kept its own), they are all-reduced on their own and equal one device's."""
    _, want = single_device(backward_once)
    net = Mlp()

    def boom(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    x, y = batch()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net).comm_fusion(SMALL)

        # (raising at l2's output: the head's and spare's buckets started, l2's and l1's not)
        def fail_there(m: nn.Module, i: object, out: torch.Tensor) -> None:
            out.register_hook(boom)

        hook = net.l2.register_forward_hook(fail_there)
        bad = parallel(world.rows(x))
        hook.remove()
        good = parallel(world.rows(x))
        with pytest.raises(RuntimeError, match="boom"):
            F.cross_entropy(bad, world.rows(y)).backward()
        net.zero_grad(set_to_none=True)
        F.cross_entropy(good, world.rows(y)).backward()
        assert_matches_single_device(grads(net), want, what="grads")


@pytest.mark.parametrize(
    ("fusion", "by_id"),
    [(None, False), ({"allreduce": {"mode": "auto"}}, False), ({"openstate": True}, True)],
    ids=["default", "allreduce-mode", "no-allreduce-mode"],
)
def test_fusion_ids_count_only_with_a_comm_fusion_without_an_allreduce_mode(
    fusion: dict[str, Any] | None, by_id: bool
) -> None:
    """As docs/parallel.md says: without hsdp(), `set_comm_fusion` ids make the gradient buckets
    only under a comm_fusion setting that has no allreduce mode; by default (25 MB) and with an
    allreduce mode every parameter of a group shares one bucket whatever its id."""
    import shardwise as sw

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    for layer, fusion_id in ((net[0], 0), (net[2], 2), (net[4], 2)):
        sw.set_comm_fusion(layer, fusion_id)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net, parallel_mode="semi_auto")
        if fusion is not None:
            parallel.comm_fusion(fusion)
        buckets = parallel.plan(shapes=[(BATCH, 8)]).buckets
    got = sorted((b.fusion, sorted(b.params)) for b in buckets)
    if by_id:
        assert got == [
            (0, ["0.bias"]),
            (0, ["0.weight"]),
            (2, ["2.bias", "2.weight", "4.bias", "4.weight"]),
        ]
    else:
        assert [(f, len(p)) for f, p in got] == [(-1, 6)]
