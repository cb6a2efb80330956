"""Sparse gradients (``nn.Embedding(sparse=True)`` with ``torch.optim.SparseAdam``), 4 simulated
ranks, each passing its rows of the global batch.

semi_auto (`_grad_buckets.GradBuckets`) and data_parallel mode (its step pre-hook) sum a sparse COO
gradient over the ranks on its own (`communication._sparse.all_reduce_sparse`: an
AllReduce(MAX) of the rows each rank holds, an AllReduce(SUM) of the values, sparse again), so
losses and parameters equal one device's after two steps (semi_auto raised a torch internal
assert, hsdp and data_parallel torch's "reshape is not implemented for sparse tensors").
An ``nn.Embedding(sparse=True)`` weight gets a gradient bucket of its own (none of its bytes in
the dense bucket); a table read by ``F.embedding(sparse=True)`` shares one and counts as
arrived. Optimizer parallel refuses a sparse gradient with a TypeError naming the parameter.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

IDS = torch.tensor([[0, 5, 5], [1, 5, 7], [2, 3, 0], [9, 9, 1]])


def make() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))


def step_of(net: nn.Sequential) -> Callable[[torch.Tensor], torch.Tensor]:
    optimizers = [
        torch.optim.SparseAdam(net[0].parameters(), lr=0.1),
        torch.optim.SGD(net[1].parameters(), lr=0.1),
    ]

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = net(x).mean()
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        return loss

    return step


# AllReduces per phase in a step (after the first): the loss's, then the Linear's gradient
# bucket, the embedding's rows and its values (data_parallel mode: at the optimizer's step)
EXPECTED = {
    "semi_auto": Counter({"forward": 1, "backward": 3}),
    "data_parallel": Counter({"forward": 1, "step": 3}),
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_sparse_embedding_trains_as_one_device(mode: str) -> None:
    one = make()
    one_step = step_of(one)
    want = [one_step(IDS).detach() for _ in range(2)]
    net = make()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(step_of(net), parallel_mode=mode)
        got = [parallel(world.rows(IDS))]
        with CommRecorder() as rec:
            got.append(parallel(world.rows(IDS)))
    for g, w in zip(got, want, strict=True):
        assert_matches_single_device(g, w, what="loss")
    for p, q in zip(net.parameters(), one.parameters(), strict=True):
        assert_matches_single_device(p.detach(), q.detach())
    assert {r.kind for r in rec.records} == {"AllReduce"}, rec.summary()
    assert Counter(r.phase for r in rec.records) == EXPECTED[mode], rec.summary()
    if mode == "semi_auto":  # (the embedding in a bucket of its own: no slot of it sent)
        sizes = sorted(r.numel for r in rec.records if r.phase == "backward")
        assert sizes == [4, 10, 30], rec.summary()  # Linear; rows held; values


class Functional(nn.Module):
    """A table read with ``F.embedding(..., sparse=True)`` (no ``nn.Embedding`` to find: its
    gradient shares a bucket with the Linear's and arrives sparse)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table = nn.Parameter(torch.randn(10, 3))
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(F.embedding(ids, self.table, sparse=True))
        return out


def test_a_sparse_gradient_in_a_shared_bucket_trains_as_one_device() -> None:
    one, net = Functional(), Functional()
    one(IDS).mean().backward()
    with simulated_world(4) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = net(x).mean()
            loss.backward()
            return loss

        sw.AutoParallel(step, parallel_mode="semi_auto")(world.rows(IDS))
    for p, q in zip(net.parameters(), one.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert p.grad.layout == q.grad.layout
        assert_matches_single_device(p.grad.to_dense(), q.grad.to_dense())


def test_optimizer_parallel_refuses_a_sparse_gradient() -> None:
    net = make()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(step_of(net), parallel_mode="semi_auto")
        parallel = parallel.hsdp(threshold=0, optimizer_level="level2")
        with pytest.raises(TypeError, match=r"parameter '0\.weight' got a torch\.sparse_coo"):
            parallel(world.rows(IDS))


def test_an_older_strategy_file_with_the_embedding_in_the_dense_bucket_loads(
    tmp_path: Path,
) -> None:
    """A file saved before sparse weights got buckets of their own lists ``0.weight`` in the
    Linear's bucket: it loads with this job's buckets (its buckets were refused as "differ from
    this job's; use the same hsdp() / comm_fusion() settings")."""
    path = tmp_path / "ops.json"
    net = make()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(step_of(net), parallel_mode="semi_auto")
        parallel(world.rows(IDS))
        parallel.save_operator_strategy_file(path)
    saved = json.loads(path.read_text())
    names = [p for b in saved["buckets"] for p in b["params"]]
    saved["buckets"] = [{**saved["buckets"][0], "params": names}]  # (one bucket, as before)
    path.write_text(json.dumps(saved))
    one, net = make(), make()
    want = step_of(one)(IDS)
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(step_of(net), parallel_mode="semi_auto")
        parallel.load_operator_strategy_file(path)
        assert_matches_single_device(parallel(world.rows(IDS)), want.detach(), what="loss")
    for p, q in zip(net.parameters(), one.parameters(), strict=True):
        assert_matches_single_device(p.detach(), q.detach())
