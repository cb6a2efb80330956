"""Ops whose arguments name sizes, under semi_auto data parallel: the plan's sizes, not the call's.

A network may give a size argument as a constant of its configuration (the global batch `B`)
or read it from a tensor (``b, t, c = h.shape``: on a rank, its local block's sizes). On one
device the two are equal; on a rank they differ. The executor gives each such op the plan's
sizes: a view / reshape / expand / ``broadcast_to`` / ``unflatten`` / ``new_zeros`` /
``new_ones`` / ``new_empty`` / ``new_full`` / ``expand_as`` / ``view_as`` / ``reshape_as`` (whose
other tensor may be a split one where the output is whole: ``bias.expand_as(h)`` crashed in the
redistribution) this rank's block of its planned output, a factory
(``torch.zeros`` / ``ones`` / ``empty`` / ``full``) its whole planned output (the plan then
slices it where a split value consumes it). Each body, in either form, equals one device on 2
ranks with no collective (every op here is local to the rows).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

B, T, C = 4, 3, 8

pytestmark = pytest.mark.usefixtures("one_thread")


class Sized(nn.Module):
    """A Linear, then one op given sizes (`body`), each in its global (`size="global"`: the
    constants B, T, C) or local form (read from the Linear's output)."""

    def __init__(self, body: str, size: str) -> None:
        super().__init__()
        self.lin, self.body, self.size = nn.Linear(C, C), body, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        b, t, c = (B, T, C) if self.size == "global" else h.shape
        body = self.body
        if body == "unflatten":
            return h.flatten(0, 1).unflatten(0, (b, t))
        if body == "torch.unflatten":
            return torch.unflatten(h.flatten(0, 1), dim=-2, sizes=(b, t))
        if body == "new_zeros":
            return h + h.new_zeros(b, t, c)
        if body == "new_ones":
            return h * h.new_ones((b, t, c), dtype=h.dtype)
        if body == "new_empty":
            return h + h.new_empty(b, t, c).zero_()
        if body == "new_full":
            return h * h.new_full((b, t, c), 2.0)
        if body == "zeros":
            return h + torch.zeros(b, t, c, dtype=h.dtype)
        if body == "full":
            return h * torch.full((b, t, c), fill_value=3.0)
        if body == "cat_new_zeros":  # (new_zeros's output is whole: DTensor's rule)
            return (torch.cat([h, h], -1) + h.new_zeros(b, t, 2 * c))[..., :c]
        if body == "new_ones_2d":
            return h + h.new_ones(b, t).unsqueeze(-1)
        if body == "expand_as":  # (a whole tensor sized by a split one)
            return h * self.lin.bias.expand_as(h) + torch.ones(c).expand_as(h)
        if body == "view_as":
            return h.flatten(0, 1).view_as(h) + h.flatten(1).reshape_as(h)
        if body == "broadcast_to":
            return torch.broadcast_to(h[:, :1], (b, t, c)) + h
        return h.reshape(b * t, c).view(b, t, c).expand(b, t, c)  # "views"


BODIES = [
    "unflatten",
    "torch.unflatten",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "zeros",
    "full",
    "cat_new_zeros",
    "new_ones_2d",
    "broadcast_to",
    "expand_as",
    "view_as",
    "views",
]


@pytest.mark.parametrize("size", ["global", "local"])
@pytest.mark.parametrize("body", BODIES)
def test_size_arguments_follow_the_plan(body: str, size: str) -> None:
    torch.manual_seed(0)
    net, x = Sized(body, size), torch.randn(B, T, C)
    want = net(x).detach()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        with CommRecorder() as rec:
            got = parallel(world.rows(x))
        assert_matches_single_device(got, world.rows(want), what=f"{body} ({size} sizes)")
        assert not rec.kinds(), rec.summary()


class Positions(nn.Module):
    """Adds ``arange(offset, offset + T)`` (an offset passed per call) and a per-row id
    ``arange(b)`` (the batch size read from the input: this rank's rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        b, t = x.shape
        pos = torch.arange(offset, offset + t).float()
        rows = torch.arange(b).float()[:, None]
        out: torch.Tensor = self.lin(x + pos) * (rows + 1)
        return out


def test_a_factory_takes_the_global_size_but_keeps_other_ints() -> None:
    """``arange(b)`` of this rank's batch size gets the global size the plan made it with (8
    rows, then cut to this rank's: the rows' own ids), while ``arange(offset, offset + t)``
    keeps each call's offset (0, then 3: no split count of the device matrix relates it to the
    captured one)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g)
    torch.manual_seed(0)
    single = Positions()
    torch.manual_seed(0)
    net = Positions()
    with simulated_world(4) as world:
        world.replicate(net)

        def step(x: torch.Tensor, offset: int) -> torch.Tensor:
            loss = net(x, offset).pow(2).mean()
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        for offset in (0, 3):
            want = single(x, offset).pow(2).mean()
            got = parallel(world.rows(x), offset)
            assert_matches_single_device(got, want.detach(), what=f"loss at offset {offset}")
