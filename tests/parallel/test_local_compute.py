"""Gather's masked lookup and Dropout's global mask under `AutoParallel` (8 simulated ranks).

Gather with its table split by rows looks up only the rows each rank holds, zeroes the rest and
sums with one AllReduce over the row axes (an index out of range raises, as on one device);
split by columns it needs no collective. Dropout draws one global noise tensor (the same as the
single-device draw under the same seed) and each rank keeps its block, so outputs and gradients
equal the single-device run with any strategy.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

WORLD, VOCAB, HIDDEN = 8, 64, 16


class EmbedNet(nn.Module):
    """ids [B, S] -> Gather(table) [B, S, H] -> MatMul(w) [B*S, 8]."""

    def __init__(self, strategy: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.table = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.w = nn.Parameter(torch.randn(HIDDEN, 8, generator=g))
        self.gather = sw.ops.Gather().shard(strategy)
        self.reshape = sw.ops.Reshape()
        self.mm = sw.ops.MatMul().shard(((8, 1), (1, 1)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.gather(self.table, ids, 0)
        out: torch.Tensor = self.mm(self.reshape(h, (-1, HIDDEN)), self.w)
        return out


class DropNet(nn.Module):
    """x [B, 32] -> MatMul [B, 16] -> Dropout (split as given) -> Mul by 2 (data parallel)."""

    def __init__(self, strategy: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 16, generator=torch.Generator().manual_seed(12)))
        self.mm = sw.ops.MatMul().shard(((2, 1), (1, 4)))
        self.drop = sw.ops.Dropout(keep_prob=0.7).shard(strategy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _mask = self.drop(self.mm(x, self.w))
        return out * 2.0


def _run(
    make: nn.Module, net: nn.Module, x: torch.Tensor
) -> tuple[dict[str, torch.Tensor], Counter[str]]:
    """Single-device values, then the parallel run compared with them; returns the forward
    collective kinds the parallel run issued (the loss's AllReduce excluded)."""
    torch.manual_seed(5)
    out = make(x)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    (out * upstream).sum().backward()
    want = {n: p.grad.clone() for n, p in make.named_parameters() if p.grad is not None}
    out_rows = out.shape[0] // WORLD
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        x_local = world.rows(x)
        w_local = world.rank_map(lambda r: upstream[r * out_rows : (r + 1) * out_rows].clone())
        torch.manual_seed(5)
        with CommRecorder() as rec:
            got = parallel(x_local)
            sw.ops.AllReduce()((got * w_local).sum()).backward()
        full = out.detach()
        assert_matches_single_device(
            got, lambda r: full[r * out_rows : (r + 1) * out_rows], what="output"
        )
        assert parallel.parallel_plan is not None
        for name, p in net.named_parameters():
            layout, shape = parallel.parallel_plan.param_layouts()[name]
            assert p.grad is not None
            assert_matches_single_device(
                p.grad, lambda r, g=want[name], a=layout, s=shape: g[a.local_slice(r, s)], what=name
            )
        kinds = Counter(r.kind for r in rec.select(phase="forward"))
        return want, kinds - Counter({"AllReduce": 1})


@pytest.mark.parametrize(
    ("strategy", "forward"),
    [
        (((8, 1), (1, 1)), {"AllReduce": 1, "AllGather": 1}),  # rows: masked lookup + AllReduce
        (((4, 2), (1, 1)), {"AllReduce": 1, "AllGather": 2}),  # rows over 4 and columns over 2
        (((1, 8), (1, 1)), {"AllGather": 1}),  # columns: plain lookup of this rank's columns
    ],
)
def test_gather(strategy: tuple[tuple[int, ...], ...], forward: dict[str, int]) -> None:
    ids = torch.randint(0, VOCAB, (16, 4), generator=torch.Generator().manual_seed(7))
    _, kinds = _run(EmbedNet(strategy), EmbedNet(strategy), ids)
    assert kinds["AllReduce"] == forward.get("AllReduce", 0), kinds
    assert kinds["ReduceScatter"] == 0


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 30])
def test_gather_of_split_rows_refuses_an_index_out_of_range(bad: int) -> None:
    """One device's lookup raises; each rank's masked one would give a zero row instead."""
    ids = torch.randint(0, VOCAB, (16, 4), generator=torch.Generator().manual_seed(7))
    ids[3, 2] = bad
    net = EmbedNet(((8, 1), (1, 1)))
    with pytest.raises(IndexError):
        net(ids)  # (one device)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        with pytest.raises(IndexError, match=r"gather \(Gather\): an index is out of range for "):
            AutoParallel(net)(world.rows(ids))


@pytest.mark.parametrize("strategy", [((8, 1),), ((2, 4),), ((1, 8),)])
def test_dropout_global_mask(strategy: tuple[tuple[int, ...], ...]) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(8))
    _run(DropNet(strategy), DropNet(strategy), x)


def test_dropout_own_seed_and_eval() -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(9))

    def make() -> DropNet:
        net = DropNet(((2, 4),))
        net.drop = sw.ops.Dropout(keep_prob=0.5, Seed0=3, Seed1=4).shard(((2, 4),))
        return net

    _run(make(), make(), x)
    single, parallel = make().eval(), make().eval()
    _run(single, parallel, x)


def test_gather_under_full_batch_reads_the_whole_indices_as_passed() -> None:
    """Each rank passes all the ids and the split table wants them whole: they are not cut at
    entry and gathered again (one AllGather a step before), only the lookup's AllReduce."""
    ids = torch.randint(0, VOCAB, (16, 4), generator=torch.Generator().manual_seed(7))

    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(11)
            self.table = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
            self.gather = sw.ops.Gather().shard(((8, 1), (1, 1)))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.gather(self.table, ids, 0)
            return out

    net = Lookup()
    want = net(ids).detach()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net).dataset_strategy("full_batch")
        with CommRecorder() as rec:
            got = parallel(world.same(ids))
        assert_matches_single_device(got.detach(), want, what="output")
    assert Counter(r.kind for r in rec.records) == Counter({"AllReduce": 1}), rec.summary()
