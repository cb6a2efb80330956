"""``nn.EmbeddingBag`` under semi_auto: a 2-D input (bags of one length) splits on its rows; a
1-D input with offsets cannot, under the data-parallel convention.

A 2-D input's bags stay on their rows (`ops.torch_rules.embedding_bag_rule`): DTensor has no
rule for the op, so the plan gathered the input and every rank computed every bag (one
AllGather a step more, N times the work).

Each rank passing its own bags (its flat tokens, its offsets from 0, as a DistributedSampler
user would) made one global input whose joined offsets restart at 0: the bags were not one
device's and the loss came out 1.174 against 1.204, silently. The plan now refuses it with a
`PlanError` naming the fix; under ``"full_batch"`` (every rank the whole input and offsets) the
same network equals one device.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import PlanError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

pytestmark = pytest.mark.usefixtures("one_thread")

V = 30
LENS = [3, 2, 4, 3, 3, 2, 4, 3]  # (8 bags; 12 tokens on each of 2 ranks)


class Bags(nn.Module):
    def __init__(self, mode: str = "mean") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag, self.fc = nn.EmbeddingBag(V, 8, mode=mode), nn.Linear(8, 3)

    def forward(
        self, flat: torch.Tensor, offsets: torch.Tensor | None = None, w: torch.Tensor | None = None
    ) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.bag(flat, offsets, per_sample_weights=w))
        return out


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    flat = torch.randint(0, V, (sum(LENS),), generator=g)
    offsets = torch.tensor([0, *LENS[:-1]]).cumsum(0)
    return flat, offsets, torch.randint(0, 3, (8,), generator=g)


def _step(net: Bags) -> object:
    def step(*args: torch.Tensor) -> torch.Tensor:
        *inputs, y = args
        loss = F.cross_entropy(net(*inputs), y)
        loss.backward()
        return loss

    return step


def test_each_ranks_own_offsets_are_refused_with_the_fix() -> None:
    flat, _, y = _data()
    net = Bags()
    with simulated_world(2) as world:
        world.replicate(net)
        k = len(LENS) // 2

        def own(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
            lens, start = LENS[rank * k : (rank + 1) * k], sum(LENS[: rank * k])
            return flat[start : start + sum(lens)], torch.tensor([0, *lens[:-1]]).cumsum(0)

        flats, offsets = world.rank_map(lambda r: own(r)[0]), world.rank_map(lambda r: own(r)[1])
        with pytest.raises(PlanError, match=r"embedding_bag .*offsets .*full_batch"):
            sw.AutoParallel(_step(net))(flats, offsets, world.rows(y))  # type: ignore[arg-type]


FORMS = ["full_batch offsets", "2-D rows", "2-D rows weighted", "2-D rows max"]


@pytest.mark.parametrize("form", FORMS)
def test_embedding_bag_matches_one_device(form: str) -> None:
    flat, offsets, y = _data()
    rows = flat[:24].view(8, 3)  # (bags of 3 tokens)
    weights = torch.rand(8, 3, generator=torch.Generator().manual_seed(2))
    mode = "sum" if "weighted" in form else "max" if "max" in form else "mean"
    forms = {"full_batch offsets": (flat, offsets), "2-D rows weighted": (rows, None, weights)}
    inputs = forms.get(form, (rows,))
    single = Bags(mode)
    want = F.cross_entropy(single(*inputs), y)
    want.backward()
    net = Bags(mode)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(_step(net))  # type: ignore[arg-type]
        if form == "full_batch offsets":
            parallel.dataset_strategy("full_batch")
            loss = parallel(*inputs, y)
        else:
            with CommRecorder() as rec:
                loss = parallel(*(t if t is None else world.rows(t) for t in inputs), world.rows(y))
            everyone = (0, 1)  # (the loss, one gradient bucket: no gather of the bags)
            assert rec.kinds() == Counter(
                {("AllReduce", "forward", everyone): 1, ("AllReduce", "backward", everyone): 1}
            ), rec.summary()
        assert_matches_single_device(loss, want.detach(), what="loss")
        for (name, p), q in zip(net.named_parameters(), single.parameters(), strict=True):
            assert_matches_single_device(p.grad, q.grad, what=f"{name}.grad")


def test_max_norm_bags_run_whole_and_train_as_one_device() -> None:
    """``max_norm`` rescales in place the weight rows the input reads: on rows split over the
    ranks each rank rescaled other rows of its copy, and the copies drifted apart (a weight
    6.44 off one device's after 3 SGD steps). Such a bag keeps its aten program's plan."""
    rows = _data()[0][:24].view(8, 3)
    y = _data()[2]

    def make() -> Bags:
        net = Bags()
        net.bag.max_norm = 1.0
        return net

    def train(net: Bags, call: Any) -> list[torch.Tensor]:
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        out = []
        for _ in range(3):
            out.append(call())
            opt.step()
            opt.zero_grad()
        return out

    single = make()
    want = train(single, lambda: _step(single)(rows, y).detach())  # type: ignore[operator]
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(_step(net))  # type: ignore[arg-type]
        got = train(net, lambda: parallel(world.rows(rows), world.rows(y)))
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_matches_single_device(g, w, what=f"loss of step {k}")
        assert_matches_single_device(net.bag.weight, single.bag.weight, what="bag.weight")
