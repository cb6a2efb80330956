"""``unbind`` of a dim a column-parallel layer split: gathered first, as one device computes.

A fused key/value projection, column parallel over mp, viewed as ``(b, t, 2, d)`` and unbound
on the split dim (``k, v = kv(x).view(b, t, 2, d).unbind(2)``; cross-attention's
``.permute(2, 0, 3, 1, 4).unbind(0)``): DTensor's rule for ``unbind`` of a split dim does not
ask to redistribute, and the plan failed with a hint about divisible batches. The op now takes
its input with the unbound dim made whole (one AllGather over mp; the batch stays split over
dp), and loss and gradient blocks equal one device's. (Where no such strategy runs, the
error names taking the parts with ``chunk`` or ``sw.reshard`` as the fix.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import assert_grad_blocks_match


class FusedKv(nn.Module):
    def __init__(self, form: str, megatron: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kv, self.form = nn.Linear(8, 16), form
        if megatron:
            sw.shard(self.kv, in_strategy=((2, 1), (2, 1)))  # column parallel: dp 2 x mp 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.form == "unbind":
            k, v = self.kv(x).view(b, t, 2, 8).unbind(2)
        else:  # (heads 2 of 4: [2, b, heads, t, head_dim])
            k, v = self.kv(x).view(b, t, 2, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        return (k * v).mean()


X = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("form", ["unbind", "permuted"])
def test_unbind_of_a_split_dim_matches_one_device(form: str) -> None:
    ref = FusedKv(form, megatron=False)
    want = ref(X)
    want.backward()
    net = FusedKv(form)
    with simulated_world(4) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(x)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            assert_matches_single_device(parallel(world.rows(X)), want.detach(), what="loss")
        assert_grad_blocks_match(parallel, net, ref)
    # (rank 0's groups) the input's rows and the kv output gathered over mp, the latter's
    # adjoint; the loss and the gradient bucket over dp
    assert rec.kinds() == Counter(
        {
            ("AllGather", "forward", (0, 1)): 2,
            ("ReduceScatter", "backward", (0, 1)): 1,
            ("AllReduce", "forward", (0, 2)): 1,
            ("AllReduce", "backward", (0, 2)): 1,
        }
    ), rec.summary()
