"""``as_strided`` (and its kin) of a value the plan moves, under semi_auto: a column-parallel
``nn.Linear``'s output gathered for it, at (dp, mp) = (1, 2) on 2 simulated ranks and (2, 2)
on 4.

``as_strided`` reads memory by strides; the gathered value arrived in the AllGather's layout
(blocks stacked along dim 0, permuted into place), not one device's, and the op read other
elements (a wrong loss, no error). A moved input is handed to it contiguous now
(`planner._strided_reads`): loss and every gradient equal one device's. A value one device
holds non-contiguous (a transpose) has no such copy: the plan is refused, naming the fix. So is
a read the copy (at storage offset 0, its own elements only) does not reproduce: a
storage_offset on a view that starts inside its base (``h[2:]``), or sizes and strides reaching
past the view into its base's storage.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.zoo import OneOp, one_step_matches
from torch import nn

import shardwise as sw
from shardwise.planner import PlanError
from shardwise.testing import simulated_world

H = 8

FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "method": lambda h: h.as_strided((8, 2), (8, 1)).repeat(1, 4),
    "function": lambda h: torch.as_strided(h, (8, 8), (4, 1), 3),
}


@pytest.mark.parametrize("split", [(1, 2), (2, 2)], ids=["dp1-mp2", "dp2-mp2"])
@pytest.mark.parametrize("form", list(FORMS))
def test_as_strided_of_a_moved_value_reads_one_devices_layout(
    form: str, split: tuple[int, int]
) -> None:
    single, net = OneOp(FORMS[form], H), OneOp(FORMS[form], H, split)
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))
    one_step_matches(split[0] * split[1], net, single, x, y)


def test_as_strided_of_a_moved_transpose_is_refused() -> None:
    net = nn.Linear(H, H)
    sw.shard(net, in_strategy=((1, 1), (2, 1)))
    x = torch.randn(8, H)
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(a).t().as_strided((8, 2), (8, 1)).sum()
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with pytest.raises(PlanError, match=r"as_strided.*non-contiguous.*\.contiguous\(\)"):
            parallel(world.rows(x))


VIEW_READS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    # h[2:] starts at storage offset 16; offset 16 reads rows 2-3 of h on one device, rows 4-5
    # of the moved copy (which starts at its own row 0)
    "offset-of-a-view": (
        lambda h: torch.as_strided(h[2:], (2, H), (H, 1), 16),
        r"storage_offset=16.*starts at storage offset 16.*\.clone\(\)",
    ),
    # rows 0-5 of h through its first 4 rows: one device reads the base past the view
    "past-the-view": (
        lambda h: h[:4].as_strided((6, H), (H, 1)),
        r"reach elements 0\.\.47 of an input of 32.*base's storage.*view's base",
    ),
}


@pytest.mark.parametrize("case", list(VIEW_READS))
def test_as_strided_of_a_moved_view_reading_outside_it_is_refused(case: str) -> None:
    read, message = VIEW_READS[case]
    net = nn.Linear(H, H)
    sw.shard(net, in_strategy=((1, 1), (2, 1)))  # column-parallel: h is gathered for the read
    x = torch.randn(8, H)
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = read(net(a)).sum()
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with pytest.raises(PlanError, match=r"as_strided.*moves it.*storage offset 0.*" + message):
            parallel(world.rows(x))


def test_as_strided_of_a_moved_view_inside_it_matches_one_device() -> None:
    """A view read inside its own elements without a storage_offset (the offset it starts at
    is its own) is what the moved copy reads: loss and gradients equal one device's."""

    class _ViewRead(nn.Module):
        def __init__(self, split: tuple[int, int] | None = None) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.head = nn.Linear(H, H), nn.Linear(H, 4)
            if split is not None:
                sw.shard(self.l1, in_strategy=((split[0], 1), (split[1], 1)))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.l1(x)[2:].as_strided((3, 2, H), (2 * H, H, 1)).flatten(1, 2)
            return F.cross_entropy(self.head(h[:, :H]), y[:3])

    x = torch.randn(8, H, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))
    one_step_matches(2, _ViewRead((1, 2)), _ViewRead(), x, y)
