"""A buffer changed by several in-place ops in one forward stays whole and equal to one
device's.

``self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))`` after a column-parallel layer (or the
same as two statements): ``add_`` reads ``mul_``'s output, the buffer itself, which the plan
held as a value of its own. semi_auto gave it this rank's block of that value and, seeing no
buffer, no gather back: each rank's buffer kept its own block updated and zeros elsewhere
(rank 0 ``[a, b, c, d, 0, 0, 0, 0]``). An in-place op's output and a view are now the value
they change, and every mode keeps an in-place op's written buffer (or alias of one) whole, as
the buffer is: the chain runs on the buffer itself and the update is gathered instead. (The
automatic planners handed such an op a block and gathered it back into the buffer after the
op, so a third op, ``clamp_``, changed only the copy of the block: the buffer kept ``add_``'s
value; a view of the buffer given as a block was refused with a PlanError.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import assert_grad_blocks_match

STEPS = 2


class Net(nn.Module):
    def __init__(self, form: str, column_parallel: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("ema", torch.zeros(8))
        if column_parallel:
            sw.shard(self.fc1, in_strategy=((1, 1), (2, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        new = h.detach().mean(0)
        if self.form == "chained":
            self.ema.mul_(0.9).add_(0.1 * new)
        elif self.form == "alpha":
            self.ema.mul_(0.9).add_(new, alpha=0.1)
        elif self.form == "statements":
            self.ema.mul_(0.9)
            self.ema.add_(0.1 * new)
        elif self.form == "single":  # (one op, on the buffer itself)
            self.ema.add_(0.1 * new)
        elif self.form == "setitem":
            self.ema[2:6] = 0.1 * new.view(4, 2).mean(1)
        elif self.form == "relu":  # (inplace=True on an in-place op's output)
            F.relu(self.ema.sub_(0.1 * new), inplace=True)
        elif self.form == "relu_then":  # (inplace=True, positional, inside a chain)
            F.relu(self.ema.add_(0.1 * new), True).mul_(0.5)
        elif self.form == "module_relu_then":  # (nn.ReLU(inplace=True) inside a chain)
            nn.ReLU(inplace=True)(self.ema.add_(0.1 * new)).mul_(0.5)
        elif self.form == "clamped":  # (three ops)
            self.ema.mul_(0.9).add_(0.1 * new).clamp_(min=-0.03)
        else:  # (a view, then three ops, the result read: "view")
            u = 0.1 * new.view(4, 2).mean(1)
            v = self.ema[:4].mul_(0.5).add_(u).clamp_(0, 0.02)
            return self.fc2(torch.tanh(h - self.ema)) * (1 + v)
        out: torch.Tensor = self.fc2(torch.tanh(h - self.ema))
        return out


g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


def _run(form: str, mode: str) -> None:
    """`STEPS` train steps on 2 ranks (the last one without the optimizer step): each step's
    loss, every rank's buffer after it and the last gradients as one device's."""
    ref = Net(form, column_parallel=False)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, emas = [], []
    for s, (x, y) in enumerate(DATA):
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        if s < STEPS - 1:
            opt_ref.step()
            opt_ref.zero_grad()
        losses.append(loss.detach())
        emas.append(ref.ema.clone())
    net = Net(form)
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            if not last:
                opt.step()
                opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode=mode)
        with CommRecorder() as rec:
            for s, (x, y) in enumerate(DATA):
                got = parallel(world.rows(x), world.rows(y), s == STEPS - 1)
                assert_matches_single_device(got, losses[s], what=f"loss {s}")
                assert_matches_single_device(net.ema, emas[s], what=f"ema after step {s}")
        assert_grad_blocks_match(parallel, net, ref)
        assert_matches_single_device(net.state_dict()["ema"], emas[-1], what="state_dict ema")
        plan = parallel.parallel_plan
        assert plan is not None
    assert [e for e in plan.edges if e.written_back] == []  # (the chain ran on the buffer)
    # (per step: x gathered for the column-parallel layer; the update's columns gathered for
    # the in-place op on the whole buffer; fc2's input made rows again (an AlltoAll, or a
    # ReduceScatter of the row-parallel product); the loss)
    rows = "AlltoAll" if mode == "semi_auto" else "ReduceScatter"
    forward = {("AllGather", "forward"): 2, (rows, "forward"): 1, ("AllReduce", "forward"): 1}
    kinds = Counter({(kind, phase): n for (kind, phase, _), n in rec.kinds().items()})
    assert {k: n for k, n in kinds.items() if k[1] == "forward"} == {
        k: STEPS * n for k, n in forward.items()
    }, rec.summary()


FORMS = ["chained", "alpha", "statements", "single", "setitem", "relu", "clamped", "view"]
FORMS += ["relu_then", "module_relu_then"]


@pytest.mark.parametrize("form", FORMS)
def test_buffer_changed_by_chained_in_place_ops_matches_one_device(form: str) -> None:
    _run(form, "semi_auto")


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
@pytest.mark.parametrize("form", FORMS)
def test_automatic_planners_keep_a_chained_buffer_update_whole(form: str, mode: str) -> None:
    _run(form, mode)
