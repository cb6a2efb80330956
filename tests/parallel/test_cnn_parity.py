"""A small conv net of shardwise primitives under `AutoParallel` (semi_auto) on 4 and 8
simulated ranks against one device.

Conv2D -> BatchNorm(is_training) -> ReLU -> MaxPool / AvgPool -> Flatten -> MatMul, trained 2
SGD steps with the loss a mean cross entropy over the global batch (each rank: its rows' mean,
AllReduce, / world). For each step: the loss, every rank's block of every parameter and of its
gradient, and BatchNorm's running statistics equal the single-device run (1e-5 relative), and
the collectives are exactly the planned ones:

- N split everywhere: BatchNorm gathers its blocks' statistics (one AllGather over the batch
  ranks; its adjoint a ReduceScatter), nothing else in forward but the loss's AllReduce; the
  replicated parameters' gradients one fused AllReduce.
- C_out split on Conv2D (and BatchNorm, ReLU, pool split alike on N x C): BatchNorm's AllGather
  runs over the N axis only; the flattened activations are redistributed to the data-parallel
  MatMul (AlltoAll; its adjoint in backward).
- C_in split on Conv2D: its partial sums need an AllReduce over the C_in axis (its adjoint in
  backward).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from tests.zoo import one_step_matches
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

BATCH, STEPS, LR = 16, 2, 0.1
S = tuple[tuple[int, ...], ...]


class ConvNet(nn.Module):
    """x [16, 4, 8, 8] -> Conv2D(8, 3, same) -> BatchNorm -> ReLU -> pool 2x2 -> Flatten ->
    MatMul [128, 10]; `plan` gives the strategies of conv, bn and the 4-D elementwise ops."""

    def __init__(self, plan: dict[str, S], pool: str = "max") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(21)
        self.w_conv = nn.Parameter(torch.randn(8, 4, 3, 3, generator=g) * 0.3)
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(8, generator=g))
        self.beta = nn.Parameter(0.1 * torch.randn(8, generator=g))
        # MindSpore's running statistics: Parameters without gradient (cut like C)
        self.moving_mean = nn.Parameter(torch.zeros(8), requires_grad=False)
        self.moving_var = nn.Parameter(torch.ones(8), requires_grad=False)
        self.w_fc = nn.Parameter(torch.randn(8 * 4 * 4, 10, generator=g) * 0.1)
        self.conv = sw.ops.Conv2D(8, 3, pad_mode="same").shard(plan["conv"])
        self.bn = sw.ops.BatchNorm(is_training=True).shard(plan["bn"])
        self.relu = sw.ops.ReLU().shard(plan["act"])
        kind = sw.ops.MaxPool if pool == "max" else sw.ops.AvgPool
        self.pool = kind(kernel_size=2, strides=2).shard(plan["act"])
        self.flatten = sw.ops.Flatten()
        self.fc = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x, self.w_conv)
        h, *_stats = self.bn(h, self.gamma, self.beta, self.moving_mean, self.moving_var)
        h = self.pool(self.relu(h))
        out: torch.Tensor = self.fc(self.flatten(h), self.w_fc)
        return out


def _bn(n: int, c: int) -> S:
    return ((n, c, 1, 1), (c,), (c,), (c,), (c,))


def plans(world: int) -> dict[str, dict[str, S]]:
    half = world // 2
    return {
        "batch": {
            "conv": ((world, 1, 1, 1), (1, 1, 1, 1)),
            "bn": _bn(world, 1),
            "act": ((world, 1, 1, 1),),
        },
        "c_out": {
            "conv": ((2, 1, 1, 1), (half, 1, 1, 1)),
            "bn": _bn(2, half),
            "act": ((2, half, 1, 1),),
        },
        "c_in": {
            "conv": ((half, 2, 1, 1), (1, 2, 1, 1)),
            "bn": _bn(world, 1),
            "act": ((world, 1, 1, 1),),
        },
    }


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(22)
    return [
        (torch.randn(BATCH, 4, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def single(net: nn.Module) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One device: losses, and parameters (running statistics included, after the forward) and
    gradients after each step's backward."""
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses, states = [], []
    for x, y in data():
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        state = {n: p.detach().clone() for n, p in net.named_parameters()}
        state |= {
            f"{n}.grad": p.grad.clone() for n, p in net.named_parameters() if p.grad is not None
        }
        losses.append(loss.item())
        states.append(state)
        opt.step()
        opt.zero_grad()
    return losses, states


def expected(world: int, case: str) -> Counter[tuple[str, str, tuple[int, ...]]]:
    """The collectives of one step (groups: those holding rank 0)."""
    every, half = tuple(range(world)), world // 2
    loss = Counter({("AllReduce", "forward", every): 1, ("AllReduce", "backward", every): 1})
    if case == "batch":  # matrix (W,): bn's statistics; one bucket for every gradient
        return loss + Counter(
            {
                ("AllGather", "forward", every): 1,
                ("ReduceScatter", "backward", every): 1,
                ("AllReduce", "backward", every): 1,
            }
        )
    if case == "c_out":  # matrix (2, W/2): g0 = N, g1 = C
        n_group, c_group = (0, half), tuple(range(half))
        return loss + Counter(
            {
                ("AllGather", "forward", c_group): 1,  # input rows -> conv x (N over g0 only)
                ("AllGather", "forward", n_group): 1,  # bn's statistics over N
                ("ReduceScatter", "backward", n_group): 1,  # (its adjoint)
                ("AlltoAll", "forward", c_group): 1,  # flatten (N, C) -> fc rows
                ("AlltoAll", "backward", c_group): 1,  # (its adjoint)
                ("AllReduce", "backward", n_group): 1,  # w_conv, gamma, beta: over N
                ("AllReduce", "backward", every): 1,  # w_fc
            }
        )
    # c_in: conv matrix (W/2, 2): g0 = N, g1 = C_in
    n_group, c_group = tuple(range(0, world, 2)), (0, 1)
    return loss + Counter(
        {
            ("AlltoAll", "forward", c_group): 1,  # input rows -> conv x (N over g0, C_in g1)
            ("AllReduce", "forward", c_group): 1,  # conv: partial sums over C_in
            ("AllReduce", "backward", c_group): 1,  # (its adjoint)
            ("AllGather", "forward", every): 1,  # bn's statistics (N over every rank)
            ("ReduceScatter", "backward", every): 1,
            ("AllReduce", "backward", n_group): 1,  # w_conv: over N
            ("AllReduce", "backward", every): 1,  # gamma, beta, w_fc
        }
    )


def check_blocks(net: nn.Module, plan: ParallelPlan, state: dict[str, torch.Tensor]) -> None:
    """Every rank's block of every parameter (running statistics included) and gradient."""
    for name, p in net.named_parameters():
        layout, _ = plan.param_layouts()[name]
        for key, value in ((name, p.detach()), (f"{name}.grad", p.grad)):
            if key in state:
                full = state[key]
                assert value is not None, key
                assert_matches_single_device(
                    value, lambda r, f=full, a=layout: f[a.local_slice(r, f.shape)], what=key
                )


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize(("case", "pool"), [("batch", "max"), ("c_out", "avg"), ("c_in", "max")])
def test_conv_net(world: int, case: str, pool: str) -> None:
    plan = plans(world)[case]
    losses, states = single(ConvNet(plan, pool))
    batches, net = data(), ConvNet(plan, pool)
    with simulated_world(world) as w:
        w.replicate(net)
        parallel = AutoParallel(net, parallel_mode="semi_auto")
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for step, (x, y) in enumerate(batches):
            with CommRecorder() as rec:
                logits = parallel(w.rows(x))
                loss = sw.ops.AllReduce()(F.cross_entropy(logits, w.rows(y))) / world
                loss.backward()
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            assert rec.kinds() == expected(world, case), rec.summary()
            assert parallel.parallel_plan is not None
            check_blocks(net, parallel.parallel_plan, states[step])
            opt.step()
            opt.zero_grad()


class _InstanceNormed(nn.Module):
    """Conv1d -> InstanceNorm1d(affine) -> max over length -> Linear; `channels`: the conv's
    output pinned split on its channels, as a user might for a per-channel op; `shuffled`:
    then a ShuffleNet channel shuffle (the channels split strided)."""

    def __init__(self, channels: bool, shuffled: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.channels, self.shuffled = channels, shuffled
        self.conv, self.norm = nn.Conv1d(4, 4, 3, padding=1), nn.InstanceNorm1d(4, affine=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if self.channels:
            h = sw.reshard(h, (1, 2, 1))
        if self.shuffled:
            b, c, n = h.shape
            h = h.reshape(b, 2, c // 2, n).transpose(1, 2).reshape(b, c, n)
        return F.cross_entropy(self.head(self.norm(h).amax(-1)), y)


def test_instance_norm_on_split_rows_and_refused_on_split_channels() -> None:
    """Split rows: each sample's norm is its own (loss and gradients equal one device's).
    Split channels: ``nn.InstanceNorm`` checks the channel count on this rank's block before
    the op (torch's own ValueError from inside the step); a PlanError names the fix, also for
    channels split strided by a channel shuffle (that was DTensor's view rule failing, with
    a fix about divisible dims that could not help)."""
    x = torch.randn(8, 4, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    one_step_matches(2, _InstanceNormed(False), _InstanceNormed(False), x, y)
    for split in (_InstanceNormed(True), _InstanceNormed(True, shuffled=True)):
        with simulated_world(2) as world:
            world.replicate(split)
            step = AutoParallel(lambda a, b, net=split: net(a, b), network=split)
            with pytest.raises(ValueError, match=r"instance_norm .*split on its channels.*resha"):
                step(world.rows(x), world.rows(y))
