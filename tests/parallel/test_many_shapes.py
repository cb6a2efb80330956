"""Many input shapes: a network called with ever new global shapes (a short last batch, every
sequence length) gets a plan per shape; past `WARN_PLANS` plans a warning says what each costs
and what to do; at most `MOST_PLANS` are kept (the oldest after the first dropped: a shape seen
again after its plan was dropped is planned again). Every call equals one device's (losses
and parameters), 4 simulated ranks; the limits are lowered here to 2 and 4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import _variants
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

ROWS = [4, 8, 12, 16, 20, 4, 8, 20]  # global batch of each call
# whether each call plans again: 8 (the 5th plan drops the 2nd, 8's) is planned again, 4 (the
# first plan, kept) and 20 (kept) are not
PLANS_AGAIN = [False, True, True, True, True, False, True, False]


def make() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def test_many_shapes_warn_once_and_keep_a_bounded_number_of_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_variants, "WARN_PLANS", 2)
    monkeypatch.setattr(_variants, "MOST_PLANS", 4)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in ROWS]
    one = make()
    one_opt = torch.optim.SGD(one.parameters(), lr=0.1)
    want = []
    for x, y in data:
        loss = F.cross_entropy(one(x), y)
        loss.backward()
        one_opt.step()
        one_opt.zero_grad()
        want.append(loss.detach())
    net = make()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        again = []
        many = r"3 plans made for this network .* pad inputs"
        with pytest.warns(UserWarning, match=many) as warned:
            for (x, y), w in zip(data, want, strict=True):
                with CommRecorder() as rec:
                    got = parallel(world.rows(x), world.rows(y))
                again.append(any(m.startswith("planned again") for m, _ in rec.marks))
                assert_matches_single_device(got, w, what=f"loss of {x.shape[0]} rows")
    assert again == PLANS_AGAIN
    assert sum("plans made for this network" in str(m.message) for m in warned) == 1
    for p, q in zip(net.parameters(), one.parameters(), strict=True):
        assert_matches_single_device(p.detach(), q.detach())
