"""A parameter shared by the networks of two `AutoParallel` wrappers (an encoder of two heads).

Each wrapper captured and ran the parameters as it found them: once one wrapper's plan stored
the shared parameter as this rank's block (a column-parallel Linear) or as an optimizer-parallel
shard (hsdp), the other took the block for the whole parameter: a silently wrong loss (module
form) and then torch's raw size mismatch in backward, or a misleading FakeKernelError in its
capture; in data_parallel mode the runners' errors blamed an optimizer built anew. Now a
wrapper that would plan or run such a parameter raises ValueError naming the parameter, both
wrappers and the fix; a shared parameter both keep whole (semi_auto, nothing annotated) still
trains as one device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
X, Y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


class Head(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin, self.head = lin, nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)))


class Regularizer(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).mean(-1)


def heads() -> tuple[nn.Linear, Head, Regularizer]:
    torch.manual_seed(0)
    lin = nn.Linear(8, 16)
    return lin, Head(lin), Regularizer(lin)


NAMED = r"parameter 'lin\.weight' of its network is also 'lin\.weight' of the network of another"


def test_a_shared_parameter_another_wrapper_stores_as_blocks_is_refused() -> None:
    lin, a, b = heads()
    sw.shard(lin, in_strategy=((1, 1), (2, 1)))  # (column parallel)
    with simulated_world(2) as world:
        world.replicate(a)
        pa, pb = sw.AutoParallel(a), sw.AutoParallel(b)
        xr = world.rows(X)
        pa(xr)  # (lin.weight now holds this rank's 8 rows)
        with pytest.raises(ValueError, match=r"AutoParallel\(Regularizer\): " + NAMED) as e:
            pb(xr)
        msg = str(e.value)
        assert "AutoParallel(Head)" in msg and "its plan stores it as this rank's block" in msg
        assert "one module holding both heads" in msg and "one train step computing both" in msg


def test_a_plan_cutting_a_parameter_another_wrapper_holds_whole_is_refused() -> None:
    lin, a, b = heads()
    with simulated_world(2) as world:
        world.replicate(a)
        pa, pb = sw.AutoParallel(a).hsdp(threshold=0), sw.AutoParallel(b)
        xr = world.rows(X)
        pb(xr)  # (whole: nothing annotated, no hsdp)
        with pytest.raises(ValueError, match=r"AutoParallel\(Head\): " + NAMED) as e:
            pa(xr)
        assert "AutoParallel(Regularizer)" in str(e.value)
        assert "this wrapper's plan would store it as this rank's block" in str(e.value)
        assert tuple(lin.weight.shape) == (16, 8)  # (refused before anything was cut)


def encoder_tasks() -> tuple[nn.Sequential, nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    return enc, nn.Sequential(enc, nn.Linear(16, 4)), nn.Sequential(enc, nn.Linear(16, 4))


def steps(a: nn.Module, b: nn.Module) -> tuple[Any, Any]:
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)

    def step_a(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(a(x), y)
        loss.backward()
        oa.step()
        oa.zero_grad()
        return loss

    def step_b(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(b(x * 2), y)
        loss.backward()
        ob.step()
        ob.zero_grad()
        return loss

    return step_a, step_b


@pytest.mark.parametrize("variant", ["hsdp", "data_parallel"])
def test_alternating_steps_sharing_a_stored_cut_encoder_are_refused(variant: str) -> None:
    _, a, b = encoder_tasks()
    with simulated_world(2) as world:
        world.replicate(a)
        world.replicate(b[1])
        step_a, step_b = steps(a, b)
        mode = "data_parallel" if variant == "data_parallel" else "semi_auto"
        pa = sw.AutoParallel(step_a, parallel_mode=mode)
        pb = sw.AutoParallel(step_b, parallel_mode=mode)
        if variant == "hsdp":
            pa.hsdp(threshold=0)
            pb.hsdp(threshold=0)
        xr, yr = world.rows(X), world.rows(Y)
        pa(xr, yr)
        match = r"AutoParallel\(step_b\) \(network Sequential\): parameter '0\.0\.weight'"
        with pytest.raises(ValueError, match=match) as e:
            pb(xr, yr)
        assert "AutoParallel(step_a) (network Sequential)" in str(e.value)
        why = "data_parallel mode averages" if variant == "data_parallel" else "optimizer-parallel"
        assert why in str(e.value)


def test_alternating_steps_sharing_a_whole_encoder_train_as_one_device() -> None:
    enc, a, b = encoder_tasks()
    step_a, step_b = steps(a, b)
    want = [s(X, Y).detach() for _ in range(2) for s in (step_a, step_b)]
    want_params = {n: p.detach().clone() for n, p in [*a.named_parameters(), ("b", b[1].weight)]}
    enc, a, b = encoder_tasks()
    with simulated_world(2) as world:
        world.replicate(a)
        world.replicate(b[1])
        pa, pb = (sw.AutoParallel(s) for s in steps(a, b))
        xr, yr = world.rows(X), world.rows(Y)
        got = [p(xr, yr) for _ in range(2) for p in (pa, pb)]
        assert_matches_single_device(got, want, what="losses")
        params = {n: p for n, p in [*a.named_parameters(), ("b", b[1].weight)]}
        assert_matches_single_device(params, want_params, what="parameters")
        del enc


def test_module_forms_sharing_a_whole_encoder_train_as_one_device() -> None:
    enc, a, b = encoder_tasks()
    opt = torch.optim.SGD([*a.parameters(), *b[1].parameters()], lr=0.1)
    want = []
    for _ in range(2):
        loss = F.cross_entropy(a(X), Y) + F.cross_entropy(b(X * 2), Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.detach())
    want_w = enc[0].weight.detach().clone()
    enc, a, b = encoder_tasks()
    with simulated_world(2) as world:
        world.replicate(a)
        world.replicate(b[1])
        pa, pb = sw.AutoParallel(a), sw.AutoParallel(b)
        opt = torch.optim.SGD([*a.parameters(), *b[1].parameters()], lr=0.1)
        xr, yr = world.rows(X), world.rows(Y)
        got = []
        for _ in range(2):
            rows = F.cross_entropy(pa(xr), yr) + F.cross_entropy(pb(xr * 2), yr)
            loss = sw.ops.AllReduce()(rows) / 2
            loss.backward()
            opt.step()
            opt.zero_grad()
            got.append(loss)
        assert_matches_single_device(got, want, what="losses")
        assert_matches_single_device(enc[0].weight, want_w, what="encoder weight")


def test_a_tied_shared_parameter_a_plan_would_cut_is_refused() -> None:
    """The shared embedding is also the head's weight (tied): a plan storing it cut (hsdp) is
    refused like an untied one (the check read the tied parameter by its last name)."""

    class Tied(nn.Module):
        def __init__(self, emb: nn.Embedding) -> None:
            super().__init__()
            self.emb, self.head = emb, nn.Linear(8, 16, bias=False)
            self.head.weight = emb.weight

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.emb(t))).logsumexp(-1).mean()

    class Reg(nn.Module):
        def __init__(self, emb: nn.Embedding) -> None:
            super().__init__()
            self.emb = emb

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.emb(t).pow(2).mean()

    torch.manual_seed(0)
    emb = nn.Embedding(16, 8)
    a, b, t = Tied(emb), Reg(emb), torch.randint(0, 16, (8, 3))
    with simulated_world(2) as world:
        world.replicate(a)
        pa, pb = sw.AutoParallel(a).hsdp(threshold=0), sw.AutoParallel(b)
        pb(world.rows(t))
        with pytest.raises(ValueError, match=r"parameter 'emb\.weight' of its network"):
            pa(world.rows(t))
    assert emb.weight.shape == (16, 8)  # (refused before anything was cut)


@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto"])
def test_a_removed_wrapper_does_not_block_the_next_stage(mode: str) -> None:
    """Two stages in one script: pretrain backbone + head 1 (its wrapper then `remove()`d),
    fine-tune backbone + head 2 in a new wrapper (hsdp under semi_auto): stage 2 runs and the
    four losses are one device's (the removed wrapper was still counted as running)."""

    def models() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        return nn.Sequential(backbone, nn.Linear(16, 4)), nn.Sequential(backbone, nn.Linear(16, 4))

    def trainer(net: nn.Module) -> Any:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    a, b = models()
    sa, sb = trainer(a), trainer(b)
    want = [sa(X, Y).detach() for _ in range(2)] + [sb(X, Y).detach() for _ in range(2)]
    a, b = models()
    with simulated_world(2) as world:
        world.replicate(a)
        world.replicate(b[1])
        pa = sw.AutoParallel(trainer(a), parallel_mode=mode)
        got = [pa(world.rows(X), world.rows(Y)) for _ in range(2)]
        pa.remove()
        pb = sw.AutoParallel(trainer(b), parallel_mode=mode)
        if mode == "semi_auto":
            pb.hsdp(threshold=0)
        got += [pb(world.rows(X), world.rows(Y)) for _ in range(2)]
        assert_matches_single_device(got, want, what="losses")
