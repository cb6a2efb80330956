"""In-place ops on a split activation that is a view, in semi_auto.

- Megatron's MLP writes its activation in place after a column-parallel ``nn.Linear`` fed a
  3-D input (``nn.ReLU(inplace=True)``, ``a.mul_(2.0)``, ``a += t``). That output is a view
  of the layer's 2-D product, and autograd runs the view again from that product inside the
  in-place op's aten program: a value the planner did not place. The in-place op's output (its
  input) was noted as that value, so the view read the 3-D placements on the 2-D product and
  the plan failed with ``... over 4 devices: 2. Fix: write it out of place`` (DTensor's
  ``KeyError: 2``). It now plans as on a 2-D input, with the same collectives, and matches
  one device.
- An exception a sharding rule raises by a fault of its own (a ``KeyError``, ``IndexError``
  or bare ``assert``) is named as such, with the op and a fix that holds (its inputs made
  whole), not its bare key.
- ``g.squeeze_(1)`` on a column-parallel ``[8, 1, 8]`` activation: the op's output was checked
  against the input's shape before the squeeze (``output dimension 1 (size 1) is not evenly
  divisible by its 2 parts``); its split now follows the removed dim, as ``squeeze``'s does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.ops.aten_rules import ATEN_RULES
from shardwise.planner import PlanError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..cached import outside_worlds

pytestmark = pytest.mark.usefixtures("one_thread")

IN_PLACE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "relu": lambda a, x: F.relu(a, inplace=True),
    "mul_": lambda a, x: a.mul_(2.0),
    "iadd": lambda a, x: a.__iadd__(x[..., :1]),
    "tanh_": lambda a, x: a.tanh_(),
}


class MLP(nn.Module):
    """Megatron's MLP on ``[8, 4, 8]``: ``fc1`` column parallel, `op` in place, ``fc2`` row
    parallel (over ``dp`` x ``mp`` = `split`; none: one device)."""

    def __init__(self, op: str, split: tuple[int, int] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.op = IN_PLACE[op]
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        if split is not None:
            dp, mp = split
            sw.shard(self.fc1, in_strategy=((dp, 1), (mp, 1)))
            sw.shard(self.fc2, in_strategy=((dp, mp), (1, mp)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = self.fc1(x)
        self.op(a, x)
        return F.mse_loss(self.fc2(a), y)


@outside_worlds
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, 8, generator=g), torch.randn(8, 4, 8, generator=g)) for _ in "ab"]


@outside_worlds
def one_device(op: str) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each step's loss, and every gradient and parameter after it (by name), on one device
    with AdamW."""
    net = make(op)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    out = []
    for x, y in batches():
        loss = net(x, y)
        loss.backward()
        state = {
            f"{n}.grad": p.grad.clone() for n, p in net.named_parameters() if p.grad is not None
        }
        opt.step()
        opt.zero_grad()
        state |= {n: p.detach().clone() for n, p in net.named_parameters()}
        out.append((loss.detach(), state))
    return out


def train(net: nn.Module, world_size: int) -> tuple[list[Any], Any, list[Counter[Any]]]:
    """Two AdamW steps of `net` in semi_auto on `world_size` simulated ranks (each passing its
    rows): the losses, each step's gradients and parameters (`check` compares them), the
    `AutoParallel` and each step's collectives."""
    seen: list[Any] = []
    comms, data = [], batches()
    with simulated_world(world_size) as world:
        world.replicate(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(x, y)
            loss.backward()
            grads = {f"{n}.grad": p.grad.clone() for n, p in net.named_parameters()}
            opt.step()
            opt.zero_grad()
            seen.append((loss, grads | {n: p.detach().clone() for n, p in net.named_parameters()}))
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        for x, y in data:
            with CommRecorder() as rec:
                parallel(world.rows(x), world.rows(y))
            comms.append(rec.kinds())
    return seen, parallel, comms


def check(seen: list[Any], parallel: Any, want: list[Any]) -> None:
    """Each step's loss, and each rank's block of every gradient and parameter, equal one
    device's (blocks cut by the layout the plan stores each parameter in)."""
    plan = parallel.parallel_plan
    for s, ((loss, got), (want_loss, full)) in enumerate(zip(seen, want, strict=True)):
        assert_matches_single_device(loss, want_loss, what=f"loss {s}")
        for key, value in got.items():
            layout = plan.params[key.removesuffix(".grad")].layout
            whole = full[key]

            def block(rank: int, f: torch.Tensor = whole, lay: Any = layout) -> torch.Tensor:
                return f[lay.local_index(rank, tuple(f.shape))]

            assert_matches_single_device(value, block, what=f"{key} step {s}")


# Per step, as rank 0 records them: x's rows gathered over mp for fc1, fc2's partial sum
# reduce-scattered over mp onto rows, the MSE loss's mean over all ranks; backward, that
# ReduceScatter's AllGather, fc2's bias gradient (its rows over all ranks) reduced over all,
# fc1's and fc2's weight blocks' (and fc1's bias block's) over dp. At 4 ranks (dp 2 x mp 2)
# mp is {0, 1} and dp {0, 2}; at 2 (mp 2) dp is one rank: its reduction is none.
COMMS = {
    4: Counter(
        {
            ("AllGather", "forward", (0, 1)): 1,
            ("ReduceScatter", "forward", (0, 1)): 1,
            ("AllReduce", "forward", (0, 1, 2, 3)): 1,
            ("AllGather", "backward", (0, 1)): 1,
            ("AllReduce", "backward", (0, 1, 2, 3)): 1,
            ("AllReduce", "backward", (0, 2)): 1,
        }
    ),
    2: Counter(
        {
            ("AllGather", "forward", (0, 1)): 1,
            ("ReduceScatter", "forward", (0, 1)): 1,
            ("AllReduce", "forward", (0, 1)): 1,
            ("AllGather", "backward", (0, 1)): 1,
            ("AllReduce", "backward", (0, 1)): 1,
        }
    ),
}


@pytest.mark.parametrize(("op", "world_size"), [*((op, 4) for op in IN_PLACE), ("relu", 2)])
def test_in_place_op_after_a_column_parallel_linear_of_3d_input_matches_one_device(
    op: str, world_size: int
) -> None:
    split = (2, 2) if world_size == 4 else (1, 2)
    seen, parallel, comms = train(MLP(op, split), world_size)
    check(seen, parallel, one_device(op))
    want = COMMS[world_size].copy()
    if op == "iadd":  # (x[..., :1], on x's rows over all ranks, gathered over mp as a's rows)
        want["AllGather", "forward", (0, 1)] += 1
    assert comms == [want, want]


class Squeezed(nn.Module):
    """A column-parallel ``fc`` (over ``dp`` x ``mp`` = `split`), its ``[8, 1, 8]`` first
    position squeezed in place (`in_place`) or not, added back to every position, then ``fc2``
    and an MSE loss."""

    def __init__(self, in_place: bool, split: tuple[int, int] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.in_place = in_place
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        if split is not None:
            sw.shard(self.fc, in_strategy=((split[0], 1), (split[1], 1)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        g = h[:, :1] * 1.0
        g = g.squeeze_(1) if self.in_place else g.squeeze(1)
        return F.mse_loss(self.fc2(h + g.unsqueeze(1)), y)


def make(op: str, split: tuple[int, int] | None = None) -> nn.Module:
    """`Squeezed` for ``"squeeze_"`` / ``"squeeze"``, else `MLP` with in-place `op`."""
    if op.startswith("squeeze"):
        return Squeezed(op == "squeeze_", split)
    return MLP(op, split)


# Per step, as rank 0 records them: x's rows gathered over mp for fc, h's columns turned into
# rows (AlltoAll over mp) for the unannotated fc2, the loss's mean over all ranks; backward,
# that AlltoAll's, fc2's gradients (its rows over all ranks) reduced over all, fc's blocks over
# dp: as with g.squeeze(1).
SQUEEZE_COMMS = Counter(
    {
        ("AllGather", "forward", (0, 1)): 1,
        ("AlltoAll", "forward", (0, 1)): 1,
        ("AllReduce", "forward", (0, 1, 2, 3)): 1,
        ("AlltoAll", "backward", (0, 1)): 1,
        ("AllReduce", "backward", (0, 1, 2, 3)): 1,
        ("AllReduce", "backward", (0, 2)): 1,
    }
)


@pytest.mark.parametrize("op", ["squeeze_", "squeeze"])
def test_squeeze_in_place_of_a_column_parallel_activation_matches_one_device(op: str) -> None:
    seen, parallel, comms = train(make(op, (2, 2)), 4)
    check(seen, parallel, one_device(op))
    assert comms == [SQUEEZE_COMMS, SQUEEZE_COMMS]


def test_a_rule_failing_by_its_own_fault_names_the_op_and_a_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rule raising ``KeyError(2)`` (as DTensor's view rule did on the placements of another
    value): the message names the op, the failure as the rule's, and the fix of making the
    inputs whole; not a bare ``: 2.``."""

    def broken(args: Any, ndim: int) -> Any:
        raise KeyError(2)

    monkeypatch.setitem(ATEN_RULES, "aten.tanh_.default", broken)
    net, data = make("tanh_", (2, 2)), batches()
    with simulated_world(4) as world, pytest.raises(PlanError) as caught:
        world.replicate(net)
        sw.AutoParallel(net, parallel_mode="semi_auto")(*(world.rows(t) for t in data[0]))
    message = str(caught.value)
    assert "tanh (torch.Tensor.tanh_ at " in message, message
    assert "aten.tanh_.default cannot run on inputs" in message
    assert "its sharding rule failed on them (KeyError: 2)" in message, message
    assert "Fix: make the op's split inputs whole before it (x = sw.reshard(x," in message
    assert ": 2." not in message
    whole = lambda a, x: sw.reshard(a, (1,) * a.dim()).tanh_()  # noqa: E731
    monkeypatch.setitem(IN_PLACE, "whole_tanh_", whole)
    net = make("whole_tanh_", (2, 2))  # (inputs already whole: no reshard to suggest)
    with simulated_world(4) as world, pytest.raises(PlanError) as caught:
        world.replicate(net)
        sw.AutoParallel(net, parallel_mode="semi_auto")(*(world.rows(t) for t in data[0]))
    message = str(caught.value)
    assert "placed ['(None, None, None)']" in message, message
    assert "Fix: annotate the op with shard(); the rule's failure is a bug" in message, message
