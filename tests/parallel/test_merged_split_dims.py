"""Views that merge or unflatten split dims into placements no layout holds.

DTensor's view rules keep such splits as ``_StridedShard`` placements:

- a reshape merging two dims split on different device axes gives ``Shard(d)`` on the outer
  axis and ``_StridedShard(d, split_factor=f)`` on the inner one, f the outer dim's local size.
  With f = 1 (the outer dim split whole) it is the plain split over both axes (outer first),
  which the plan follows with no communication; with f > 1 each rank's elements are not its
  block of every group, no `TensorLayout`: semi_auto makes a split whole first (an AllGather
  over the inner axis) instead of failing inside `from_placements`;
- a view of a dim strided in g groups into a dim of fewer than g x split elements (an
  unflatten after a transpose-merge, twice): a candidate the search skips, instead of failing
  in its cost model's redistribution planner.

Loss and gradient blocks equal one device's.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import assert_grad_blocks_match


class MergeBmm(nn.Module):
    """A batch matmul whose output [n, 16, 4] is split (2, 1, 4), then merged to [16, 4n]."""

    def __init__(self, n: int, annotate: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.n = n
        self.w = sw.Parameter(torch.randn(n, 4, 4))
        self.bmm = sw.ops.BatchMatMul()
        if annotate:
            self.bmm.shard(((2, 1, 1), (2, 1, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bmm(x.view(16, self.n, 4).permute(1, 0, 2), self.w)
        return y.permute(1, 0, 2).reshape(16, 4 * self.n).pow(2).mean()


def _run(net: nn.Module, ref: nn.Module, x: torch.Tensor, mode: str, give: str) -> CommRecorder:
    want = ref(x)
    want.backward()
    with simulated_world(8) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(x)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode=mode)
        if give == "full_batch":
            parallel.dataset_strategy("full_batch")
        with CommRecorder() as rec:
            got = parallel(world.same(x) if give == "full_batch" else world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_grad_blocks_match(parallel, net, ref)
    return rec


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation", "recursive_programming"])
def test_merge_of_dims_split_whole_is_a_plain_split(mode: str, one_thread: None) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    rec = _run(MergeBmm(2), MergeBmm(2, annotate=False), x, mode, "data_parallel")
    if mode == "semi_auto":  # (the input moved to the bmm, the loss; the merge moves nothing)
        assert rec.kinds() == Counter(
            {
                ("AlltoAll", "forward", (0, 1, 2, 3)): 1,
                ("AlltoAll", "forward", (0, 4)): 1,
                ("AllGather", "forward", (0, 1, 2, 3)): 1,
                ("AllReduce", "forward", tuple(range(8))): 1,
            }
        ), rec.summary()


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation", "recursive_programming"])
def test_merge_no_layout_holds_gathers_the_inner_split(mode: str, one_thread: None) -> None:
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    rec = _run(MergeBmm(4), MergeBmm(4, annotate=False), x, mode, "data_parallel")
    if mode != "semi_auto":
        return
    # (as above, plus the bmm's output gathered over g1 before the merge and its adjoint; the
    # merged [16, 16] is split over g0 only, so the loss is reduced over g0)
    assert rec.kinds() == Counter(
        {
            ("AlltoAll", "forward", (0, 1, 2, 3)): 1,
            ("AlltoAll", "forward", (0, 4)): 1,
            ("AllGather", "forward", (0, 1, 2, 3)): 2,
            ("ReduceScatter", "backward", (0, 1, 2, 3)): 1,
            ("AllReduce", "forward", (0, 4)): 1,
        }
    ), rec.summary()


class TwiceTransposed(nn.Module):
    """A lookup into a parameter, viewed (B, 2, 4), transposed and merged back, twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = sw.Parameter(torch.randn(16, 8))
        self.lin = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb[ids]
        for _ in range(2):
            x = x.view(16, 2, 4).permute(0, 2, 1).reshape(16, 8)
        return self.lin(x).pow(2).mean()


@pytest.mark.parametrize("give", ["data_parallel", "full_batch"])
def test_search_skips_a_strided_view_no_layout_holds(give: str, one_thread: None) -> None:
    ids = torch.randint(0, 16, (16,), generator=torch.Generator().manual_seed(1))
    _run(TwiceTransposed(), TwiceTransposed(), ids, "recursive_programming", give)
