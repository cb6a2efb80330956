"""Ops on a batch split over a tuple of axes in an order other than the mesh's.

A `Layout` of mesh ``("dp", "mp")`` whose batch is ``("mp", "dp")`` (mp outer) is DTensor's
``_StridedShard`` on dp next to ``Shard`` on mp. ``torch.cat`` / ``torch.stack``, the pointwise
losses (``mse_loss``), ``masked_fill`` with a tensor value and CPU attention keep such a batch
split with no communication, exactly as a batch over ``("dp", "mp")``: the only collectives are
the loss's AllReduce and the gradients' (4 simulated ranks, parity with one device).
``torch.stack`` at or before a split dim moves the split one dim on (a plain split too).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

LAYOUT = sw.Layout((2, 2), ("dp", "mp"))
EVERY = (0, 1, 2, 3)
LOSS_AND_GRADS = Counter({("AllReduce", "forward", EVERY): 1, ("AllReduce", "backward", EVERY): 1})
CASES = ["cat", "stack_last", "stack_first", "mse_loss", "masked_fill", "attention"]

g = torch.Generator().manual_seed(3)
X = torch.randn(8, 8, generator=g)
LABELS = torch.randint(0, 4, (8,), generator=g)
TARGETS = torch.randn(8, 4, generator=g)


class Net(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case = case
        joins = case in ("cat", "stack_last", "stack_first")
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(16 if joins else 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)  # [B, 8]
        if self.case == "stack_last":
            j = torch.stack((h, h.tanh()), dim=-1).flatten(1)
        elif self.case == "stack_first":  # (the batch moves to dim 1)
            j = torch.stack((h, h.tanh()), dim=0).permute(1, 0, 2).flatten(1)
        elif self.case == "cat":
            j = torch.cat((h, -h), dim=-1)
        elif self.case == "masked_fill":
            j = h.masked_fill(h > 0.2, torch.tensor(0.5))
        elif self.case == "attention":
            q = h.view(-1, 2, 2, 2)  # [B, heads, seq, head dim]
            j = F.scaled_dot_product_attention(q, q.tanh(), q, is_causal=True).flatten(1)
        else:  # (mse_loss)
            j = h
        out: torch.Tensor = self.l2(j)
        return out


def loss_of(net: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return F.mse_loss(out, y) if net.case == "mse_loss" else F.cross_entropy(out, y)


def run(case: str, batch: tuple[str, str]) -> tuple[torch.Tensor, Counter, dict, Net]:
    """The loss, the collectives and the gradients (every rank's) of one step on 4 ranks."""
    y = TARGETS if case == "mse_loss" else LABELS
    strategy = (LAYOUT(batch, "None"), LAYOUT(batch, "None") if y.dim() == 2 else LAYOUT(batch))
    net = Net(case)
    with simulated_world(4) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net, a, b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step).dataset_strategy(strategy)
        rows = [
            world.rank_map(lambda r, t=t, s=s: t[s.local_index(r, tuple(t.shape))].clone())
            for t, s in zip((X, y), strategy, strict=True)
        ]
        with CommRecorder() as rec:
            loss = parallel(*rows)
    grads = {n: p.grad for n, p in net.named_parameters()}
    return loss, rec.kinds(), grads, net


@pytest.mark.parametrize("case", CASES)
def test_a_batch_over_the_later_axis_first_needs_no_collectives(case: str) -> None:
    ref = Net(case)
    y = TARGETS if case == "mse_loss" else LABELS
    want = loss_of(ref, X, y)
    want.backward()
    for batch in (("dp", "mp"), ("mp", "dp")):
        loss, kinds, grads, _ = run(case, batch)
        assert_matches_single_device(loss, want.detach(), what=f"{case} loss, batch {batch}")
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        assert_matches_single_device(grads, ref_grads, what=f"{case} grads, batch {batch}")
        assert kinds == LOSS_AND_GRADS, (case, batch, kinds)
