"""What a forward hook or ``self.last = h`` keeps is the rank's value as the plan places it.

A value the call keeps outside its return value is the tensor the rank holds there: after a
row-parallel layer that is this rank's partial sum, before the AllReduce that makes the whole
value (the returned output is whole). ``sw.reshard(h, (1, 1))`` in the hook gives the whole
value, the plan's one AllReduce reused (docs/parallel.md, capture).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world


def make() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4), nn.Tanh(), nn.Linear(4, 2))


def test_a_hook_after_a_row_parallel_layer_keeps_the_partial_sum_unless_resharded() -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    single, net = make(), make()
    want_out = single(x).detach()
    want = single[2](single[1](single[0](x))).detach()
    raw: list[torch.Tensor] = []
    whole: list[torch.Tensor] = []
    net[2].register_forward_hook(lambda m, i, o: raw.append(o))
    net[2].register_forward_hook(lambda m, i, o: whole.append(sw.reshard(o, (1, 1))))
    with torch.no_grad(), simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net[0], in_strategy=((1, 1), (2, 1)))  # (column parallel)
        sw.shard(net[2], in_strategy=((1, 2), (1, 2)))  # (row parallel: a partial sum)
        parallel = sw.AutoParallel(net).dataset_strategy("full_batch")
        with CommRecorder() as rec:
            out = parallel(world.same(x))
        assert_matches_single_device(out, want_out, what="returned output")
        assert_matches_single_device(whole[0], want, what="resharded hook value")
        parts = world.local_tensors(raw[0])
        assert_matches_single_device(parts[0] + parts[1], want, what="sum of the kept parts")
        assert not torch.allclose(parts[0], want, atol=1e-3)  # (a part, not the whole)
        assert rec.kinds() == Counter(  # (full_batch's input rows; the one partial sum)
            {("AllGather", "forward", (0, 1)): 1, ("AllReduce", "forward", (0, 1)): 1}
        ), rec.summary()
