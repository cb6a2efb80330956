"""One value in two argument slots of one op (``h * h``, ``torch.mul(h, h)``, ``h.mul(h)``) when
it is a partial sum: a row-parallel ``nn.Linear``'s output, or a sum over a column-parallel
one's columns, under semi_auto at (dp, mp) = (1, 2) on 2 simulated ranks and (2, 2) on 4.

DTensor runs ``mul(partial, partial)`` as (partial, whole) -> partial. The planner gave the value
one placement per op, the one the later slot wants (whole), yet kept the output partial: both
factors arrived whole and the product was summed over the ranks again (the loss doubled). Each
slot now gets the same placement and the rule's answer for it (`_follow._Follow._place`): loss
and every gradient equal one device's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.zoo import one_step_matches
from torch import nn

import shardwise as sw

H = 8

FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "h*h": lambda h: h * h,
    "torch.mul": lambda h: torch.mul(h, h),
    "h*h*h": lambda h: h * h * h,
    "mul-add": lambda h: h.mul(h).add(h),
    "s*s": lambda h: h * (lambda s: s * s)(h.sum(1, keepdim=True)),
}


class _Squared(nn.Module):
    """`l1` annotated row parallel (`form` other than ``s*s``) or column parallel (``s*s``:
    its row sums are partial over mp), its output through `form`, then a head and a loss."""

    def __init__(self, form: str, split: tuple[int, int] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.l1, self.head = nn.Linear(H, H), nn.Linear(H, 4)
        if split is not None:
            dp, mp = split
            strategy = ((dp, 1), (mp, 1)) if form == "s*s" else ((dp, mp), (1, mp))
            sw.shard(self.l1, in_strategy=strategy)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = FORMS[self.form](self.l1(x) * 0.5)
        return F.cross_entropy(self.head(h), y) + (h * h).mean()


@pytest.mark.parametrize("split", [(1, 2), (2, 2)], ids=["dp1-mp2", "dp2-mp2"])
@pytest.mark.parametrize("form", list(FORMS))
def test_a_partial_sum_in_two_slots_of_one_op(form: str, split: tuple[int, int]) -> None:
    single, net = _Squared(form), _Squared(form, split)
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))
    one_step_matches(split[0] * split[1], net, single, x, y)
