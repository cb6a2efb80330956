"""Unannotated torch ops under `AutoParallel` (semi_auto: data parallel) on 8 simulated ranks.

Seed 003's network with matmul3 replaced by ``nn.Linear(512, 10)`` and relu2 by ``F.relu``, the
loss ``nn.CrossEntropyLoss`` computed inside the wrapped call: for 3 SGD steps the loss (the same
on every rank), every parameter block and gradient block equal the single-device run, and the
collectives are exactly the planned ones (the primitives' as in `test_seed003_parity`, the
loss's AllReduce and one gradient AllReduce for the replicated Linear's two parameters: one
bucket). Also: a network of torch
ops only (MSE loss), and the errors for ops the runtime cannot run data parallel.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

sys.path.insert(0, str(Path(__file__).parent))
from test_seed003_parity import train_single

WORLD, BATCH, STEPS, LR = 8, 32, 3, 0.1
W = (0, 1, 2, 3, 4, 5, 6, 7)


class Network(nn.Module):
    """Seed 003's network (int strategies), matmul3 -> nn.Linear, relu2 -> F.relu."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.flatten = sw.ops.Flatten()
        self.fc1_weight = nn.Parameter(torch.randn(28 * 28, 512, generator=g) * 0.05)
        self.fc2_weight = nn.Parameter(torch.randn(512, 512, generator=g) * 0.05)
        self.matmul1 = sw.ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu1 = sw.ops.ReLU().shard(((4, 1),))
        self.matmul2 = sw.ops.MatMul().shard(((1, 8), (8, 1)))
        self.fc3 = nn.Linear(512, 10)
        with torch.no_grad():
            self.fc3.weight.copy_(torch.randn(10, 512, generator=g) * 0.05)
            self.fc3.bias.copy_(torch.randn(10, generator=g) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flatten(x)
        x = self.relu1(self.matmul1(x, self.fc1_weight))
        x = F.relu(self.matmul2(x, self.fc2_weight))
        logits: torch.Tensor = self.fc3(x)
        return logits


class WithLoss(nn.Module):
    def __init__(self, net: nn.Module, loss_fn: nn.Module) -> None:
        super().__init__()
        self.net, self.loss_fn = net, loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.loss_fn(self.net(x), y)
        return loss


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def single_device() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses, and parameters + gradients after each step's backward (before the update)."""
    return train_single(Network(), data(), LR)


# Forward as seed 003's (matmul1, matmul2 and their input redistributions; F.relu slices the
# replicated matmul2 output to rows, nn.Linear runs on rows), then the loss's AllReduce.
COMMS = Counter(
    {
        ("AllGather", "forward", (0, 1)): 1,
        ("AlltoAll", "forward", (0, 2)): 1,
        ("AllReduce", "forward", (0, 1, 2, 3)): 1,  # matmul1
        ("AlltoAll", "forward", (0, 4)): 1,
        ("AllGather", "forward", (0, 2)): 1,
        ("AllReduce", "forward", W): 2,  # matmul2; the loss (cross entropy, mean)
        # matmul2; fc3.weight + fc3.bias (2 per-parameter AllReduces: one bucket now); the
        # loss: seeded, none
        ("AllReduce", "backward", W): 2,
        ("AllReduce", "backward", (0, 4)): 1,  # fc1_weight: replicated over g0
        ("AllReduce", "backward", (0, 1, 2, 3)): 1,  # matmul1
        ("AlltoAll", "backward", (0, 4)): 1,
        ("ReduceScatter", "backward", (0, 2)): 1,
    }
)


def rows(t: torch.Tensor) -> object:
    n = BATCH // WORLD
    return lambda r: t[r * n : (r + 1) * n].clone()


def check_params(net: nn.Module, plan: ParallelPlan, state: dict[str, torch.Tensor]) -> None:
    """Each rank's block of every parameter and gradient (whole for unannotated modules)."""
    for name, p in net.named_parameters():
        want, grad = state[name], state[f"{name}.grad"]
        if name in plan.params:
            layout, shape = plan.param_layouts()[name]
            for value, full in ((p.detach(), want), (p.grad, grad)):
                assert value is not None
                assert_matches_single_device(
                    value,
                    lambda r, f=full, lay=layout, s=shape: f[lay.local_slice(r, s)],
                    what=name,
                )
        else:
            assert_matches_single_device(p.detach(), want, what=name)
            assert_matches_single_device(p.grad, grad, what=f"{name}.grad")


def test_linear_relu_and_cross_entropy_run_data_parallel() -> None:
    losses, states = single_device()
    batches, net, loss_fn = data(), Network(), nn.CrossEntropyLoss()

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(net(inputs), targets)
        loss.backward()
        return loss

    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(forward_backward)
        assert parallel.network is net
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for step, (x, y) in enumerate(batches):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))  # each rank passes its rows
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            assert rec.kinds() == COMMS, rec.summary()
            assert parallel.parallel_plan is not None
            stored = parallel.parallel_plan.param_layouts()
            split = {n for n, (layout, _) in stored.items() if layout.used_axes()}
            assert split == {"fc1_weight", "fc2_weight"}  # as the MatMuls want them
            check_params(net, parallel.parallel_plan, states[step])
            opt.step()
            opt.zero_grad()


class Mlp(nn.Module):
    """Torch ops only: flatten, Linear, ReLU, +, *, softmax, view."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(12, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x.flatten(1))) * 2 + 1
        out: torch.Tensor = F.softmax(self.l2(h), dim=-1).view(h.size(0), 2, 2)
        return out


def test_torch_only_network_mse_sum_and_mean() -> None:
    x, y = torch.randn(16, 3, 4), torch.randn(16, 2, 2)
    ref = WithLoss(Mlp(), nn.MSELoss())
    loss = ref(x, y) + F.mse_loss(ref.net(x), y, reduction="sum") + ref.net(x).sum(1).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    net = Mlp()

    def total(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = net(a)
        return F.mse_loss(out, b) + F.mse_loss(out, b, reduction="sum") + out.sum(1).mean()

    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(total, network=net)
        got = parallel(world.rows(x), world.rows(y))
        got.backward()
        assert_matches_single_device(got, loss.detach(), what="loss")
        for n, p in net.named_parameters():
            assert_matches_single_device(p.grad, grads[f"net.{n}"], what=n)


class Bad(nn.Module):
    def __init__(self, body: str) -> None:
        super().__init__()
        self.body = body
        self.w = nn.Parameter(torch.ones(8, 8))
        self.mm = sw.ops.MatMul().shard(((1, 8), (8, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.mm(x, self.w)
        if self.body == "softmax0":
            return F.softmax(h, dim=0)
        if self.body == "view":
            return h.view(-1)
        if self.body == "plain":
            return h
        return torch.sort(h, dim=1).values


@pytest.mark.parametrize("body", ["softmax0", "view", "sort"])
def test_torch_ops_across_the_batch_are_planned(body: str) -> None:
    """After a primitive, torch ops that mix the rows (softmax over dim 0, a view folding the
    batch, a sort along the columns of the replicated output) run as the plan says (the
    primitive runtime refused them): each rank's output rows equal one device's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 8, generator=g)
    ref = Bad(body)
    with torch.no_grad():
        ref.w.copy_(torch.randn(8, 8, generator=g))
    want = ref(x).detach()
    net = Bad(body)
    net.load_state_dict(ref.state_dict())
    rows = want.shape[0] // WORLD
    with simulated_world(WORLD) as world:
        parallel = AutoParallel(world.replicate(net))
        got = parallel(world.rows(x))
        assert_matches_single_device(got, lambda r: want[r * rows : (r + 1) * rows], what=body)


def test_block_parameter_in_a_torch_op_outside_the_network() -> None:
    """A train step that reads a block-stored parameter outside the network's forward (a
    weight penalty): the capture records that op too and the plan gives it the whole value."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 8, generator=g)
    ref = Bad("plain")
    with torch.no_grad():
        ref.w.copy_(torch.randn(8, 8, generator=g))
    want = (ref(x).sum() + ref.w.sum()).detach()
    net = Bad("plain")
    net.load_state_dict(ref.state_dict())
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def step(inputs: torch.Tensor) -> torch.Tensor:
            return net(inputs).sum() + net.w.sum()

        got = AutoParallel(step)(world.rows(x))
        assert_matches_single_device(got, want, what="penalized sum")
