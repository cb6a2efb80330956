"""Seed 003 under `AutoParallel` on 8 simulated ranks against the single-device run.

The network is seed 003's (Flatten, MatMul ((2, 4), (4, 1)), ReLU ((4, 1),), MatMul ((1, 8),
(8, 1)), ReLU ((8, 1),), MatMul default), MNIST-shaped input, global batch 32, loss = mean cross
entropy over the global batch (each rank: its rows' mean, AllReduce, / 8). For 3 SGD steps:

- the loss on every rank equals the single-device loss;
- every rank's block of every parameter (and of its gradient) equals the same slice of the
  single-device tensor (1e-5 relative);
- the collectives of each step are exactly the planned ones (kind, phase, group, count):
  the operators' AllReduces, the redistributions between primitives (their plans are listed
  next to FORWARD / COMMS_LAYOUT), the user's loss AllReduce and, in backward, their adjoints
  plus one gradient AllReduce per parameter replicated on some axis.

Run for seed 003's int strategies and for its Layout version.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.layout import TensorLayout
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan
from shardwise.testing import (
    CommRecorder,
    assert_matches_single_device,
    simulated_world,
)

WORLD, BATCH, STEPS, LR = 8, 32, 3, 0.1


class Network(nn.Module):
    """Seed 003's network: int strategies, or (`layouts`) the seed's Layout version; weights
    from a fixed generator, or (`initializer`) the seed's ``sw.initializer("normal", ...)``."""

    def __init__(self, layouts: bool = False, initializer: bool = False) -> None:
        super().__init__()
        self.flatten = sw.ops.Flatten()
        if initializer:
            self.fc1_weight = sw.Parameter(sw.initializer("normal", [28 * 28, 512]), name="fc1")
            self.fc2_weight = sw.Parameter(sw.initializer("normal", [512, 512]), name="fc2")
            self.fc3_weight = sw.Parameter(sw.initializer("normal", [512, 10]), name="fc3")
        else:
            g = torch.Generator().manual_seed(3)
            self.fc1_weight = nn.Parameter(torch.randn(28 * 28, 512, generator=g) * 0.05)
            self.fc2_weight = nn.Parameter(torch.randn(512, 512, generator=g) * 0.05)
            self.fc3_weight = nn.Parameter(torch.randn(512, 10, generator=g) * 0.05)
        self.matmul1 = sw.ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu1 = sw.ops.ReLU().shard(((4, 1),))
        self.matmul2 = sw.ops.MatMul().shard(((1, 8), (8, 1)))
        if layouts:
            layout = sw.Layout((2, 2, 2), ("dp", "sp", "mp"))
            layout2 = sw.Layout((8,), ("tp",))
            self.matmul1.shard((layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None")))
            self.matmul2.shard((layout2("None", "tp"), layout2("tp", "None")))
        self.relu2 = sw.ops.ReLU().shard(((8, 1),))
        self.matmul3 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flatten(x)
        x = self.matmul1(x, self.fc1_weight)
        x = self.relu1(x)
        x = self.matmul2(x, self.fc2_weight)
        x = self.relu2(x)
        logits: torch.Tensor = self.matmul3(x, self.fc3_weight)
        return logits


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def train_single(
    net: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Single-device SGD with cross entropy: losses, and parameters + gradients after each
    step's backward (before the update). Shared by the parallel parity tests."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses, states = [], []
    for x, y in batches:
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


def single_device(layouts: bool) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses, and parameters + gradients after each step's backward (before the update)."""
    return train_single(Network(layouts), data(), LR)


W = (0, 1, 2, 3, 4, 5, 6, 7)
# Per step, on the global matrix (g0, g1, g2) = (2, 2, 2) (common refinement of [2, 4, 1],
# [4, 1, 2], [1, 8, 1], [8, 1], [8, 1, 1]); groups are those holding rank 0.
FORWARD = Counter(
    {
        # flatten -> matmul1 x: ((g0, g1, g2), None) -> (g0, (g1, g2))
        ("AllGather", "forward", (0, 1)): 1,
        ("AlltoAll", "forward", (0, 2)): 1,
        ("AllReduce", "forward", (0, 1, 2, 3)): 1,  # matmul1: K split over d1 (4 ranks)
        # relu1 (Slice only) -> matmul2 x: ((g0, g1), None) -> (None, (g0, g1, g2))
        ("AlltoAll", "forward", (0, 4)): 1,
        ("AllGather", "forward", (0, 2)): 1,
        ("AllReduce", "forward", W): 2,  # matmul2: K split over all 8; the user's loss
    }
)
BACKWARD = Counter(
    {
        ("AllReduce", "backward", W): 3,  # loss, matmul2, fc3_weight (replicated on all)
        ("AllReduce", "backward", (0, 4)): 1,  # fc1_weight: replicated over g0
        ("AllReduce", "backward", (0, 1, 2, 3)): 1,  # matmul1
        ("AlltoAll", "backward", (0, 4)): 1,  # adjoint of the matmul2 input redistribution
        ("ReduceScatter", "backward", (0, 2)): 1,
    }
)


def blocks(full: torch.Tensor, layout: TensorLayout) -> Callable[[int], torch.Tensor]:
    """rank -> that rank's block of the single-device tensor `full`."""
    return lambda r: full[layout.local_slice(r, full.shape)]


def check_blocks(net: Network, plan: ParallelPlan, state: dict[str, torch.Tensor]) -> None:
    """Every rank's block of every parameter and of its gradient vs the single-device slice."""
    for name, p in net.named_parameters():
        layout, shape = plan.param_layouts()[name]
        assert tuple(state[name].shape) == shape and p.grad is not None
        assert_matches_single_device(p.detach(), blocks(state[name], layout), what=name)
        grad = blocks(state[f"{name}.grad"], layout)
        assert_matches_single_device(p.grad, grad, what=f"{name}.grad")


@pytest.mark.parametrize("layouts", [False, True], ids=["int", "layout"])
def test_seed003_losses_parameters_and_collectives(layouts: bool) -> None:
    losses, states = single_device(layouts)
    batches, net = data(), Network(layouts)
    expected = COMMS_LAYOUT if layouts else FORWARD + BACKWARD
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR)  # before the first call: same Parameters
        for step, (x, y) in enumerate(batches):
            with CommRecorder() as rec:
                logits = parallel(world.rows(x))
                loss = sw.ops.AllReduce()(F.cross_entropy(logits, world.rows(y))) / WORLD
                loss.backward()
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            assert rec.kinds() == expected, rec.summary()
            assert parallel.parallel_plan is not None
            check_blocks(net, parallel.parallel_plan, states[step])
            opt.step()
            opt.zero_grad()


# The Layout version on (g0, g1, g2) = (dp, sp, mp): matmul1 x is (mp, (sp, dp)) = (g2, (g1, g0)),
# its weight ((g1, g0), None); matmul2 on tp = (g0, g1, g2).
COMMS_LAYOUT = Counter(
    {
        # input -> matmul1 x: AllGather g2, AlltoAll g1, AlltoAll g0, Slice g2
        ("AllGather", "forward", (0, 1)): 2,  # (and relu1's, below)
        ("AlltoAll", "forward", (0, 2)): 1,
        ("AlltoAll", "forward", (0, 4)): 2,  # (and matmul2's, below)
        ("AllReduce", "forward", (0, 2, 4, 6)): 1,  # matmul1: K split over (sp, dp)
        # matmul1 out (g2, None) -> relu1 ((g0, g1), None): AlltoAll g2, Slices, AllGather g2
        ("AlltoAll", "forward", (0, 1)): 1,
        # relu1 out -> matmul2 x (None, (g0, g1, g2)): AllGather g1, AlltoAll g0, Slices
        ("AllGather", "forward", (0, 2)): 1,
        ("AllReduce", "forward", W): 2,  # matmul2 (tp = all 8); the user's loss
        ("AllReduce", "backward", W): 3,  # loss, matmul2, fc3_weight
        ("AllReduce", "backward", (0, 1)): 1,  # fc1_weight: replicated over mp = g2
        ("AllReduce", "backward", (0, 2, 4, 6)): 1,  # matmul1
        ("AlltoAll", "backward", (0, 4)): 1,  # adjoints of the two activation redistributions
        ("ReduceScatter", "backward", (0, 2)): 1,
        ("AlltoAll", "backward", (0, 1)): 1,
        ("ReduceScatter", "backward", (0, 1)): 1,
    }
)


def test_seed003_plan() -> None:
    with simulated_world(WORLD) as world:
        net = Network()
        parallel = AutoParallel(net)
        plan = parallel.plan(world.rank_map(lambda r: torch.zeros(BATCH // WORLD, 1, 28, 28)))
        assert plan.matrix.shape == (2, 2, 2)
        got = {n: (str(lay).split(" on ")[0], s) for n, (lay, s) in plan.param_layouts().items()}
        assert got == {
            "fc1_weight": ("((g1, g2), None)", (784, 512)),
            "fc2_weight": ("((g0, g1, g2), None)", (512, 512)),
            "fc3_weight": ("(None, None)", (512, 10)),
        }
        assert tuple(net.fc1_weight.shape) == (196, 512)
        assert tuple(net.fc2_weight.shape) == (64, 512)
