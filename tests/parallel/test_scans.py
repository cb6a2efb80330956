"""Scans (``cumsum``, ``cumprod``, ``logcumsumexp``) over a split dim named by a negative index,
semi_auto on 2 and 4 simulated ranks.

torch 2.13's DTensor rule for scans compares the dim with the split dims without normalizing
it: ``h.cumsum(-1)`` of a tensor split on its last dim kept the split and each rank scanned its
own block (a wrong loss, no error). The dim is normalized before DTensor is asked
(`ops._dtensor.NEGATIVE_DIMS`): the scanned dim is gathered first, and the loss and every
gradient equal one device's, for the batch rows (data parallel, ``cumsum(-2)`` of ``[B, H]``)
and for the features of a column-parallel ``nn.Linear`` (``cumsum(-1)``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.zoo import one_step_matches
from torch import nn

import shardwise as sw

BATCH, H = 8, 16

SCANS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "cumsum": lambda h, d: h.cumsum(d),
    "cumprod": lambda h, d: (h * 0.1 + 1).cumprod(d),
    "logcumsumexp": lambda h, d: h.logcumsumexp(d),
}


class _Scan(nn.Module):
    def __init__(self, scan: str, dim: int) -> None:
        super().__init__()
        self.scan, self.dim = SCANS[scan], dim
        self.l1, self.head = nn.Linear(H, H), nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.scan(self.l1(x), self.dim)), y)


@pytest.mark.parametrize("scan", list(SCANS))
@pytest.mark.parametrize(("world_size", "split"), [(2, "rows"), (4, "features")])
def test_a_scan_over_a_split_dim_by_negative_index(scan: str, world_size: int, split: str) -> None:
    torch.manual_seed(0)
    dim = -2 if split == "rows" else -1
    single, net = _Scan(scan, dim), _Scan(scan, dim)
    net.load_state_dict(single.state_dict())
    if split == "features":  # (column parallel: l1's output features over all ranks)
        sw.shard(net.l1, in_strategy=((1, 1), (world_size, 1)))
    x, y = torch.randn(BATCH, H), torch.randint(0, 4, (BATCH,))
    one_step_matches(world_size, net, single, x, y)
