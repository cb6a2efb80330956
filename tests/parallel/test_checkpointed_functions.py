"""Custom ``torch.autograd.Function``s that save tensors, inside activation-checkpointed regions.

A region's recomputation in backward replays the plan (`parallel/_recompute.py`); a Function's
``ctx.save_for_backward`` there packs its tensors through the saved-tensor hook on top (torch's
recomputation hook, which detaches them; a reentrant region's: the caller's, e.g.
``save_on_cpu``), whose ops are no ops of the network's. Before, the replay matched them
against the plan and raised (``the network called torch.Tensor.detach where the plan has op
...``). Loss, gradients and parameters after two AdamW steps equal one device's; the
collectives are the plan's, the recomputation's included.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

STEPS = 2
pytestmark = pytest.mark.usefixtures("one_thread")


class Square(torch.autograd.Function):
    """x * x, saving its input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Softsign(torch.autograd.Function):
    """x / (1 + |x|), saving the denominator (an intermediate of its forward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        d = 1 + x.abs()
        ctx.save_for_backward(d)
        return x / d

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (d,) = ctx.saved_tensors
        return g / (d * d)


class Net(nn.Module):
    """A linear layer, then a checkpointed region: fc1, both Functions, fc2; an MSE loss."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.reentrant = reentrant

    def region(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(Softsign.apply(Square.apply(self.fc1(h))))
        return out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.region, self.inp(x), use_reentrant=self.reentrant)
        return F.mse_loss(h, y)


def megatron(net: Net) -> None:
    """fc1 column parallel, fc2 row parallel, over (dp, mp) = (2, 2)."""
    sw.shard(net.fc1, in_strategy=((2, 1), (2, 1)))
    sw.shard(net.fc2, in_strategy=((2, 2), (1, 2)))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STEPS)]


Result = list[tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def trainer(net: Net, out: Result, hooks: bool) -> Any:
    """A train step with AdamW; appends (loss, gradients, parameters after the step) to `out`;
    the forward and backward under ``save_on_cpu`` when `hooks`."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu() if hooks else contextlib.nullcontext():
            loss = net(x, y)
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append(
            (loss.detach(), grads, {n: p.detach().clone() for n, p in net.named_parameters()})
        )
        return loss

    return step


def run(how: str) -> Counter[Any]:
    """Train `how`'s case on simulated ranks against one device; returns the collectives each
    step ran (kind, phase, ranks) and, under ``("recompute", kind)``, the recomputation's."""
    reentrant, hooks = "reentrant" in how, "save_on_cpu" in how
    data, want, got = batches(), [], []
    single = trainer(Net(reentrant), want, hooks)
    for x, y in data:
        single(x, y)
    net = Net(reentrant)
    with simulated_world(4 if "megatron" in how else 2) as world:
        world.replicate(net)
        if "megatron" in how:
            megatron(net)
        mode = "sharding_propagation" if "propagation" in how else "semi_auto"
        parallel = sw.AutoParallel(trainer(net, got, hooks), parallel_mode=mode)
        with CommRecorder() as rec:
            for x, y in data:
                parallel(world.rows(x), world.rows(y))
        for s, ((loss, grads, params), (want_loss, want_grads, want_params)) in enumerate(
            zip(got, want, strict=True)
        ):
            assert_matches_single_device(loss, want_loss, what=f"loss {s}")
            for name, p in parallel.parallel_plan.params.items():
                for what, value, full in [
                    ("grad", grads[name], want_grads[name]),
                    ("param", params[name], want_params[name]),
                ]:
                    block = lambda r, f=full, lay=p.layout: f[lay.local_index(r, tuple(f.shape))]  # noqa: E731
                    assert_matches_single_device(value, block, what=f"{name} {what} {s}")
    kinds = rec.kinds()
    kinds.update(("recompute", r.kind) for r in rec.records if r.label.startswith("recompute"))
    return kinds


def data_parallel(buckets: int = 1) -> Counter[Any]:
    """Data parallel on 2 ranks: the loss's AllReduce and the gradient buckets' per step."""
    return Counter(
        {
            ("AllReduce", "forward", (0, 1)): STEPS,
            ("AllReduce", "backward", (0, 1)): buckets * STEPS,
        }
    )


MEGATRON = Counter(
    {
        ("AllGather", "forward", (0, 1)): STEPS,  # (fc1's input, whole over mp)
        ("ReduceScatter", "forward", (0, 1)): STEPS,  # (fc2's partial sums)
        ("AllReduce", "forward", (0, 1, 2, 3)): STEPS,  # (the loss)
        ("AllGather", "backward", (0, 1)): 2 * STEPS,  # (the ReduceScatter's; the recomputed)
        ("ReduceScatter", "backward", (0, 1)): STEPS,  # (the AllGather's)
        ("AllReduce", "backward", (0, 2)): STEPS,  # (the split weights' bucket, over dp)
        ("AllReduce", "backward", (0, 1, 2, 3)): STEPS,  # (the whole ones')
        ("recompute", "AllGather"): STEPS,  # (torch's early stop: fc2's own collective not)
    }
)
"""fc1 column parallel, fc2 row parallel over (dp, mp) = (2, 2), ranks (0, 1) one mp group."""


@pytest.mark.parametrize(
    ("how", "want"),
    [
        ("semi_auto", data_parallel()),
        ("sharding_propagation", data_parallel()),
        ("megatron", MEGATRON),
        ("megatron, propagation", MEGATRON),
        # (the reentrant region's own backward fills a bucket of its own, as without Functions)
        ("reentrant, save_on_cpu", data_parallel(buckets=2)),
    ],
)
def test_saving_functions_in_a_checkpointed_region_match_one_device(
    how: str, want: Counter[Any]
) -> None:
    """Non-reentrant regions: torch's recomputation hook detaches each saved tensor. Reentrant
    under ``save_on_cpu``: the recomputation saves through that hook (its copies to the CPU)."""
    assert run(how) == want
