"""A fill made from this rank's batch size and changed by item assignment (FNO's SpectralConv:
``out = torch.zeros(x.size(0), C, L // 2 + 1, dtype=torch.cfloat); out[:, :, :M] = ...``).

The plan made the fill whole, and the assignment, run data parallel, wanted this rank's rows
of it: a `PlanError` ("sets items of a value in place, but the plan moves it first"), since the
change would land in the cut copy. Now such a fill is made as this rank's rows where the
assignment would cut it (and every earlier read cut them too): the change lands in the tensor
later ops read, and the losses, gradients and parameters after two AdamW steps equal one
device's on 2 and 4 ranks, in semi_auto and sharding_propagation, with exactly the data
parallel collectives (the loss's AllReduce, a gradient bucket per dtype). A fill read whole
before the assignment still moves, and stays refused.
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

from ..cached import outside_worlds
from ..zoo import recording_step

C, L, M, BATCH, STEPS = 4, 16, 5, 8, 2


class Spectral(nn.Module):
    """Lift, one FNO spectral convolution (complex weights, a zeros spectrum filled by item
    assignment) with a skip, project; or (``kind="linear"``) a float zeros half filled."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "spectral":
            self.w = nn.Parameter(torch.randn(C, C, M, dtype=torch.cfloat) * 0.3)
        self.lift = nn.Linear(1, C)
        self.proj = nn.Linear(C, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lift(x.unsqueeze(-1)).permute(0, 2, 1)  # (batch, C, L)
        if self.kind == "linear":
            out = torch.zeros(x.size(0), C, L)
            out[:, :, : L // 2] = h[:, :, : L // 2]
            h = torch.tanh(out + h)
        else:
            xf = torch.fft.rfft(h, dim=-1)
            spectrum = torch.zeros(x.size(0), C, L // 2 + 1, dtype=torch.cfloat)
            spectrum[:, :, :M] = torch.einsum("bix,iox->box", xf[:, :, :M], self.w)
            h = F.gelu(torch.fft.irfft(spectrum, n=L, dim=-1) + h)
        return F.mse_loss(self.proj(h.permute(0, 2, 1)).squeeze(-1), y)


@outside_worlds
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, L, generator=g), torch.randn(BATCH, L, generator=g))
        for _ in range(STEPS)
    ]


@outside_worlds
def one_device(kind: str) -> list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]:
    """Each step's loss, gradients and parameters after AdamW's step, on one device."""
    net = Spectral(kind)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    out = []
    for x, y in batches():
        loss = net(x, y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append(
            (loss.detach(), grads, {n: p.detach().clone() for n, p in net.named_parameters()})
        )
    return out


def _blocks(parallel: Any, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`want` (whole parameters or gradients) cut as the plan stores each parameter."""
    plan = parallel.parallel_plan
    assert plan is not None

    def cut(full: torch.Tensor, layout: Any) -> Any:
        return lambda r: full[layout.local_index(r, tuple(full.shape))]

    return {n: cut(t, plan.params[n].layout) for n, t in want.items()}


@pytest.mark.parametrize(
    ("kind", "mode", "world_size"),
    [
        ("spectral", "semi_auto", 2),
        ("spectral", "semi_auto", 4),
        ("spectral", "sharding_propagation", 2),
        ("spectral", "sharding_propagation", 4),
        ("linear", "semi_auto", 2),
        ("linear", "sharding_propagation", 4),
    ],
)
def test_an_item_assigned_zeros_of_this_ranks_rows_matches_one_device(
    kind: str, mode: str, world_size: int
) -> None:
    want, data = one_device(kind), batches()
    net = Spectral(kind)
    with simulated_world(world_size) as world:
        world.replicate(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        seen: list[dict[str, torch.Tensor]] = []
        step = recording_step(net, opt, lambda net, x, y: net(x, y), seen)
        parallel = sw.AutoParallel(step, parallel_mode=mode)
        with CommRecorder() as rec:
            for s, (x, y) in enumerate(data):
                loss = parallel(world.rows(x), world.rows(y))
                assert_matches_single_device(loss, want[s][0], what=f"loss {s}")
                assert_matches_single_device(seen[s], _blocks(parallel, want[s][1]))
                params = {n: p.detach() for n, p in net.named_parameters()}
                assert_matches_single_device(params, _blocks(parallel, want[s][2]))
        ranks = tuple(range(world_size))
        buckets = 2 if kind == "spectral" else 1  # (a bucket per dtype: complex64 and float32)
        assert rec.kinds() == Counter(
            {
                ("AllReduce", "forward", ranks): STEPS,
                ("AllReduce", "backward", ranks): STEPS * buckets,
            }
        ), rec.summary()
        plan = parallel.parallel_plan
        assert plan is not None
        zeros = plan.node("zeros")
        assert str(zeros.outputs[0]) == "(g0, None, None)", plan
        assert not [e for e in plan.edges if e.value == f"%{zeros.index}"], plan


def test_a_zeros_read_whole_before_item_assignment_is_refused() -> None:
    """The whole fill's sum is read before the assignment would cut it: made whole, it would
    move for the assignment, whose change would land in the copy."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            out = torch.zeros(x.size(0), 8)
            total = out.sum()
            out[:, :4] = h[:, :4]
            return (out + total).pow(2).mean()

    x = batches()[0][0][:, :8].contiguous()
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(a)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        with pytest.raises(
            PlanError,
            match=r"__setitem__ .* sets items of a value in place, but the plan moves it first "
            r"\(\(None, None\) -> \(g0, None\)\)",
        ):
            parallel(world.rows(x))
