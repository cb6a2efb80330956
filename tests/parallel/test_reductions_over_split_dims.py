"""Torch reductions across the split batch dim whose partial results do not add up: a max, a
min, a norm, a product (``x.amax(0)``, ``x.max()``, ``x.norm(dim=0)``, ``x.prod(0)``,
``F.normalize(x, dim=0)``) under semi_auto and sharding_propagation on 4 simulated ranks.

DTensor's rules leave such a reduction of a split dim partial by max / min / norm / product;
the plan reduces partial values by sum or mean only (they were summed: a wrong loss, no error).
The rows are now gathered before such an op (`aten_rules.odd_partial_axes`): loss and every
gradient equal one device's, and the collectives are exactly the rows' AllGather (its adjoint a
ReduceScatter), the loss's AllReduce and the weight's gradient AllReduce.

A boolean ``any`` over a split dim (``(h > 0.5).any(0).float()`` under plain data parallel,
``.any(1)`` of a column-parallel output) is a logical or, which DTensor calls a partial sum; its
inputs are gathered the same way (the sum was carried through the cast and counted the ranks).

Also a mean over the split rows read by an op that adds a bias (``nn.Linear``, ``addmm``,
``baddbmm``): the mean is a partial average, and the bias stays whole on every rank (it was
kept on the first rank only, as for a partial sum: divided by the ranks after the average).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.zoo import OneOp, one_step_matches
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

WORLD, BATCH, H = 4, 16, 8

REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "amax": lambda y: y.amax(0),
    "amin": lambda y: y.amin(0),
    "max": lambda y: y.max(),
    "norm": lambda y: y.norm(dim=0),
    "prod": lambda y: (y * 0.1 + 1).prod(0),
    "normalize": lambda y: F.normalize(y, dim=0),
}


class Net(nn.Module):
    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.reduce = reduce
        self.w = nn.Parameter(torch.randn(H, H, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        return (y + self.reduce(y)).pow(2).mean()


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_a_reduction_that_does_not_add_up_gathers_its_rows(name: str, mode: str) -> None:
    x = torch.randn(BATCH, H, generator=torch.Generator().manual_seed(4))
    single = Net(REDUCTIONS[name])
    want = single(x)
    want.backward()
    net = Net(REDUCTIONS[name])
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a)
            loss.backward()
            return loss

        with CommRecorder() as rec:
            got = sw.AutoParallel(step, parallel_mode=mode)(world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_matches_single_device(net.w.grad, single.w.grad, what="w.grad")
    every = tuple(range(WORLD))
    assert rec.kinds() == Counter(
        {
            ("AllGather", "forward", every): 1,  # the rows, before the reduction
            ("ReduceScatter", "backward", every): 1,  # (its adjoint)
            ("AllReduce", "forward", every): 1,  # the loss
            ("AllReduce", "backward", every): 1,  # w's gradient
        }
    ), rec.summary()


class _MeanContext(nn.Module):
    """A batch-context vector (`ctx` of the rows' mean; `addmm` and `baddbmm` read the mean
    as the bias's addend) added to every row: the mean over the split rows is a partial
    average, and the bias the op adds to it must stay whole on every rank."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.l1, self.ctx, self.head = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        m = h.mean(0, keepdim=True)
        if self.form == "linear":
            g = self.ctx(m)
        elif self.form == "addmm":
            g = torch.addmm(self.ctx.bias, m, self.ctx.weight.T)
        else:
            g = torch.baddbmm(self.ctx.bias, m.unsqueeze(0), self.ctx.weight.T.unsqueeze(0))[0]
        return F.cross_entropy(self.head(h + g), y)


@pytest.mark.parametrize("form", ["linear", "addmm", "baddbmm"])
def test_a_bias_added_to_a_mean_over_split_rows(form: str) -> None:
    """The bias of an op reading a partial average was kept on the first rank and zeroed on
    the others (a partial sum's conversion): after the average it was divided by the ranks."""
    torch.manual_seed(0)
    single, net = _MeanContext(form), _MeanContext(form)
    net.load_state_dict(single.state_dict())
    x, y = torch.randn(BATCH, H), torch.randint(0, 4, (BATCH,))
    _, rec = one_step_matches(WORLD, net, single, x, y)
    every = tuple(range(WORLD))
    assert rec.kinds()[("AllGather", "forward", every)] == 0, rec.summary()  # (no rows moved)


# (`l1`'s output masked by a boolean ``any`` over a dim the plan splits: the rows under data
# parallel; the columns ("columns") when `l1` is column parallel over (dp, mp))
ANY_FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "float": lambda h: h * (h > 0.5).any(dim=0, keepdim=True).float(),
    "sum": lambda h: h + (h > 0.5).any(dim=0).sum(),
    "long": lambda h: h * (h > 0.5).any(dim=0).long(),
    "to": lambda h: h * (h > 0.5).any(dim=0).to(h.dtype),
    "columns": lambda h: h * (h > 0).any(dim=1, keepdim=True).float(),
}


@pytest.mark.parametrize(
    ("form", "world", "split"),
    [
        ("float", 2, None),
        ("sum", 2, None),
        ("long", 2, None),
        ("to", 2, None),
        ("float", 4, None),
        ("columns", 2, (1, 2)),
        ("columns", 4, (2, 2)),
    ],
)
def test_any_over_a_split_dim_is_a_logical_or(
    form: str, world: int, split: tuple[int, int] | None
) -> None:
    """DTensor calls ``mask.any(dim)`` over a split dim a partial sum; the plan carried it
    through the cast (or the sum) and summed the cast values: a column True on two ranks
    became 2.0. The split is gathered before the ``any`` now, as before a max."""
    single, net = OneOp(ANY_FORMS[form], H), OneOp(ANY_FORMS[form], H, split)
    x = torch.randn(BATCH, H, generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 4, (BATCH,), generator=torch.Generator().manual_seed(6))
    one_step_matches(world, net, single, x, y)
