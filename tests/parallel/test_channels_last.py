"""A channels-last CNN (plain torch, nothing annotated) on 4 simulated ranks: Conv2d -> ReLU ->
AdaptiveAvgPool2d(1) -> Linear with its input in ``torch.channels_last``.

Under channels_last ``adaptive_avg_pool2d`` runs as a mean and an ``as_strided_`` putting back
the memory format, which had no sharding rule: the pool ran whole and its input was gathered
from every rank each step. That restride changes no value (`ops.aten_rules.restride_rule`), so
the pool stays split by rows as for a contiguous input: the only forward collective is the
loss's AllReduce, and the loss and every gradient equal one device's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tests.zoo import one_step_matches
from torch import nn


class Net(nn.Module):
    def __init__(self, channels_last: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.channels_last = channels_last
        self.conv, self.pool, self.fc = (
            nn.Conv2d(3, 8, 3, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Linear(8, 10),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        h = self.pool(torch.relu(self.conv(x)))
        return F.cross_entropy(self.fc(torch.flatten(h, 1)), y)


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_pool_stays_split_by_rows(channels_last: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    net = Net(channels_last)
    parallel, rec = one_step_matches(4, net, copy.deepcopy(net), x, y)
    assert parallel.strategies()["pool/adaptive_avg_pool2d"] == ((4, 1, 1, 1),)
    forward = [(r.kind, r.group) for r in rec.select(phase="forward")]
    assert forward == [("AllReduce", (0, 1, 2, 3))], rec.summary()  # (the loss's)
