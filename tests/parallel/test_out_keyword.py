"""Ops writing their result into ``out=`` tensors inside a wrapped step
(``c = torch.empty_like(o); torch.cumsum(o.detach(), 1, out=c)``).

The capture took such a call as a write into its input 0, and nothing placed the out tensor:
under Megatron (``o`` a row-parallel layer's partial sum, ``c`` an ``empty_like`` of it) the
loss came out wrong without an error, or planning failed with a meaningless PlanError; under
plain data parallel the run failed moving ``c``. Now the call is the node of the op's result,
planned as any op from its inputs, and the out tensor holds this rank's block of it (its
earlier contents and placement are not read): loss, gradients and parameters equal one
device's over two steps. ``out=`` into a view of another tensor and a factory with ``out=``
are refused with the fix.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import CaptureError
from shardwise.testing import assert_matches_single_device, simulated_world

T = torch.Tensor


def _cumsum(o: T) -> T:
    c = torch.empty_like(o)
    torch.cumsum(o, 1, out=c)
    return c


def _cumsum_rows(o: T) -> T:  # (over the split batch dim; out= a new_empty)
    c = o.new_empty(o.shape)
    torch.cumsum(o, 0, out=c)
    return c


def _exp(o: T) -> T:
    c = torch.empty_like(o)
    torch.exp(o, out=c)
    return c


def _clamp(o: T) -> T:
    c = torch.empty_like(o)
    torch.clamp(o, min=0, out=c)
    return c


def _resized(o: T) -> T:  # (an out tensor of another shape: resized, as on one device)
    c = torch.empty(0)
    torch.tanh(o, out=c)
    return c


def _aliased(o: T) -> T:  # (out= its own input: read as it was)
    c = o * 0.5
    torch.exp(c, out=c)
    return c


def _returned(o: T) -> T:  # (the value the call returns: the out tensor)
    return torch.cumsum(o, 1, out=torch.empty_like(o))


def _max(o: T) -> T:  # (two out tensors)
    values, indices = o.new_empty(0), o.new_empty(0, dtype=torch.long)
    torch.max(o, 1, keepdim=True, out=(values, indices))
    return values + indices


FORMS: dict[str, Callable[[T], T]] = {
    "cumsum": _cumsum,
    "cumsum_rows": _cumsum_rows,
    "exp": _exp,
    "clamp": _clamp,
    "resized": _resized,
    "aliased": _aliased,
    "returned": _returned,
    "max": _max,
}


class Net(nn.Module):
    def __init__(self, form: Callable[[T], T]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: T) -> T:
        o = self.fc2(torch.tanh(self.fc1(x)))
        return self.fc3(torch.tanh(o + self.form(o.detach())))


g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


def stepper(net: nn.Module, grads: list[dict[str, T]]) -> Callable[[T, T], T]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def step(x: T, y: T) -> T:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
        return loss

    return step


def megatron(net: nn.Module) -> None:
    sw.shard(net.fc1, in_strategy=((1, 1), (2, 1)))  # (column parallel)
    sw.shard(net.fc2, in_strategy=((1, 2), (1, 2)))  # (row parallel: o is a partial sum)


def check_parity(form: str, mode: str, annotate: bool) -> None:
    ref = Net(FORMS[form])
    want_grads: list[dict[str, T]] = []
    one = stepper(ref, want_grads)
    want = [one(x, y).detach() for x, y in DATA]
    net = Net(FORMS[form])
    seen: list[dict[str, T]] = []
    with simulated_world(2) as world:
        world.replicate(net)
        if annotate:
            megatron(net)
        parallel = sw.AutoParallel(stepper(net, seen), parallel_mode=mode)
        got = [parallel(world.rows(x), world.rows(y)) for x, y in DATA]
        plan = parallel.parallel_plan
        assert plan is not None
        for i in range(len(DATA)):
            assert_matches_single_device(got[i].detach(), want[i], what=f"loss {i}")
            for name, full in want_grads[i].items():
                lay = plan.params[name].layout
                block = lambda r, f=full, lay=lay: f[lay.local_index(r, tuple(f.shape))]  # noqa: E731
                assert_matches_single_device(seen[i][name], block, what=f"grad {i} {name}")
        for name, p in ref.named_parameters():
            lay = plan.params[name].layout
            full = p.detach()
            block = lambda r, f=full, lay=lay: f[lay.local_index(r, tuple(f.shape))]  # noqa: E731
            assert_matches_single_device(net.get_parameter(name).detach(), block, what=name)


@pytest.mark.parametrize("annotate", [False, True], ids=["plain", "megatron"])
@pytest.mark.parametrize("form", list(FORMS))
def test_out_keyword_under_semi_auto_trains_as_one_device(form: str, annotate: bool) -> None:
    check_parity(form, "semi_auto", annotate)


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
@pytest.mark.parametrize("form", ["cumsum", "exp", "clamp"])
def test_out_keyword_under_automatic_modes_trains_as_one_device(form: str, mode: str) -> None:
    check_parity(form, mode, annotate=mode == "sharding_propagation")


def _view(o: T) -> T:
    c = torch.zeros(8, 32)
    torch.exp(o, out=c[:, :16])
    return c[:, 16:]


def _factory(o: T) -> T:
    c = torch.empty(16)
    torch.arange(16.0, out=c)
    return o + c


@pytest.mark.parametrize(
    ("form", "match"),
    [(_view, r"torch\.exp at .*into a view.*out=.*c = torch\.exp\(\.\.\.\)"),
     (_factory, r"torch\.arange at .*out=.*factories.*c = torch\.arange\(\.\.\.\)")],
)  # fmt: skip
def test_out_keyword_it_cannot_follow_is_refused_with_the_fix(
    form: Callable[[T], T], match: str
) -> None:
    net = Net(form)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net, []), parallel_mode="semi_auto")
        x, y = DATA[0]
        with pytest.raises(CaptureError, match=match):
            parallel(world.rows(x), world.rows(y))
