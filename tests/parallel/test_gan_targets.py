"""A GAN step whose targets are made from the batch's size (``torch.ones(real.shape[0], 1)``,
or as its method: ``real.new_ones(real.shape[0], 1)``, ``new_zeros``, ``new_full``,
``new_empty(...).fill_``) before ``d_loss.backward()`` and read again after it, by the
generator's loss on ``D(fake)``.

The plan makes such a fill whole, at the global batch's size (the loss that reads it in the
plan gathers its rows); the forward after the backward runs outside the plan on this rank's
rows, so the target used to reach it whole and torch's loss failed (``Target size (8, 1) must
be the same as input size (4, 1)``). Now a fill the step's code sized as this rank's rows is
read outside the plan as those rows: the parameters and the discriminator's loss equal one
device's, and the generator's loss is this rank's mean (docs/parallel.md). A target derived
from it in the plan (``* 0.9``) is held whole: the error gets a note naming it and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

RANKS = 2
g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]

Targets = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (from the batch)
TARGETS: dict[str, Targets] = {
    "ones": lambda x: (torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)),
    "size tuple": lambda x: (torch.ones((x.shape[0], 1)), torch.zeros(size=(x.shape[0], 1))),
    "full": lambda x: (torch.full((x.shape[0], 1), 0.9), torch.full((x.shape[0], 1), 0.1)),
    "new_ones": lambda x: (x.new_ones(x.shape[0], 1), x.new_zeros((x.shape[0], 1))),
    "new_full": lambda x: (x.new_full((x.shape[0], 1), 0.9), x.new_empty(x.shape[0], 1).fill_(0.1)),
}


def build() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Module()
    net.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    net.D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return net


def gan_step(net: nn.Module, targets: Targets, rows: list[torch.Tensor] | None = None) -> Any:
    """D's step, then G's: G's loss reads the targets made before D's backward. `rows`: each
    call's per-row losses of G (one device)."""
    g_opt = torch.optim.Adam(net.G.parameters(), 1e-2, eps=1e-6)
    d_opt = torch.optim.SGD(net.D.parameters(), 0.1, momentum=0.9)

    def step(real: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fake = net.G(z)
        real_t, fake_t = targets(real)
        d_loss = F.binary_cross_entropy_with_logits(net.D(real), real_t)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(net.D(fake.detach()), fake_t)
        d_opt.zero_grad()
        d_loss.backward()
        d_opt.step()
        d_fake = net.D(fake)  # (after a backward: outside the plan, on this rank's rows)
        g_loss = F.binary_cross_entropy_with_logits(d_fake, real_t)
        if rows is not None:
            each = F.binary_cross_entropy_with_logits(d_fake, real_t, reduction="none")
            rows.append(each.detach())
        g_opt.zero_grad()
        g_loss.backward()
        g_opt.step()
        return d_loss.detach(), g_loss.detach()

    return step


@pytest.mark.parametrize(
    ("made", "mode"),
    [(made, "semi_auto") for made in TARGETS] + [("new_ones", "sharding_propagation")],
)
def test_targets_sized_from_the_batch_are_this_ranks_rows_after_the_backward(
    made: str, mode: str
) -> None:
    ref = build()
    rows: list[torch.Tensor] = []
    one = gan_step(ref, TARGETS[made], rows)
    want = [one(real, z) for real, z in DATA]
    net = build()
    with simulated_world(RANKS) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(gan_step(net, TARGETS[made]), parallel_mode=mode)
        got = [parallel(world.rows(real), world.rows(z)) for real, z in DATA]
        for i, ((d_loss, g_loss), (d_want, _)) in enumerate(zip(got, want, strict=True)):
            assert_matches_single_device(d_loss, d_want, what=f"d_loss {i}")
            mean = rows[i].view(RANKS, -1).mean(1)  # (each rank's rows' mean)
            assert_matches_single_device(g_loss, lambda r, m=mean: m[r], what=f"g_loss {i}")
        full = {n: p.detach() for n, p in ref.named_parameters()}
        assert_matches_single_device(
            {n: p.detach() for n, p in net.named_parameters()}, full, what="parameters"
        )


def test_a_target_derived_in_the_plan_names_the_fix() -> None:
    """``torch.ones(b, 1) * 0.9`` is the plan's mul, held whole: the op after the backward
    that reads it with this rank's rows fails, and torch's error says why."""
    real, z = DATA[0]
    net = build()
    smoothed: Targets = lambda x: (torch.ones(x.shape[0], 1) * 0.9, torch.zeros(x.shape[0], 1))  # noqa: E731
    with simulated_world(RANKS) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(gan_step(net, smoothed), parallel_mode="semi_auto")
        with pytest.raises(ValueError, match="Target size") as err:
            parallel(world.rows(real), world.rows(z))
    msg = "\n".join(err.value.__notes__)
    assert "binary_cross_entropy_with_logits after loss.backward() reads the output" in msg
    assert "mul" in msg and "holds whole ([8, 1]" in msg and "rows ([4, 1])" in msg
    assert "torch.ones_like(d_out)" in msg
