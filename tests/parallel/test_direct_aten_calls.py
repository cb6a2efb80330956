"""Direct ``torch.ops.aten.*`` calls in a network are ops of the graph like any other: planned
by their own (DTensor's) sharding rules on the layouts the plan gives their inputs. They were
skipped by the capture and ran unplanned on each rank's block: a slice of a column-split
activation cut the wrong columns, silently."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.zoo import one_step_matches
from torch import nn

import shardwise as sw

aten = torch.ops.aten


class SlicedColumns(nn.Module):
    """A column-parallel Linear, then aten ops on its split output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16, bias=False), nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = aten.slice(h, -1, 2, 6)  # (columns 2..5: across the column split)
        h = aten.mul.Tensor(h, aten.sigmoid(h))
        out = self.b(h)
        return aten.mean.default(aten.pow.Tensor_Scalar(aten.sub.Tensor(out, y), 2))


@pytest.mark.parametrize(("world", "dp"), [(2, 1), (4, 2)])
def test_aten_calls_on_a_split_activation_match_one_device(world: int, dp: int) -> None:
    net = SlicedColumns()
    single = copy.deepcopy(net)
    sw.shard(net.a, in_strategy=((dp, 1), (world // dp, 1)))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
    parallel, _ = one_step_matches(world, net, single, x, y)
    names = [n for n in parallel.strategies() if "slice" in n]
    assert names, list(parallel.strategies())


class AsksDevice(SlicedColumns):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        torch.ops.prim.device(x)  # (metadata, in both call forms: no node)
        torch.ops.prim.device.default(x)
        return super().forward(x, y)


def test_prim_calls_are_metadata_in_both_call_forms() -> None:
    """``torch.ops.prim.device(x)`` (a packet) became a node of the plan while its overload
    form did not; neither does now."""
    net = AsksDevice()
    single = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
    parallel, _ = one_step_matches(2, net, single, x, y)
    assert "prim.device" not in str(parallel.parallel_plan)
