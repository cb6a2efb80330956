"""``zero_grad`` between two backward calls under optimizer parallel level 1, the module form
(``out = parallel_net(x)``, ``loss.backward()`` in the user's loop).

Level 1 holds each rank's full gradients on the compute weights until the optimizer step (the
parameters' ``.grad`` is None until then), so ``optimizer.zero_grad()`` and
``net.zero_grad()`` found nothing to clear: the step reduced the discarded backward's gradients
with the next one's (a probe's backward, a GAN's generator loss run through the
discriminator), 1.7e-2 off one device after one step. Now ``zero_grad`` of an optimizer or a
module holding the parameters drops their held gradients (``set_to_none=False``: the
parameter's ``.grad`` is zeros, as one device's), with no collective: the ReduceScatters are
those of the step, as before. 2 simulated ranks; results equal one device's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
X1, X2 = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
GAN_DATA = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def shard_rows(parallel: sw.AutoParallel, name: str, full: torch.Tensor) -> Any:
    """rank -> the rows of the one-device `full` that rank's shard of `name` holds (a network
    replicated on 2 ranks: a sharded parameter's dim-0 halves)."""
    plan = parallel.optimizer_plan
    assert plan is not None
    shard = plan.param(name)
    if not shard.sharded:
        return full
    n = shard.shard_shape[0]
    return lambda r: full[(r % shard.shard) * n : (r % shard.shard + 1) * n]


def reduce_scatters_only_at_the_step(parallel: sw.AutoParallel, rec: CommRecorder) -> None:
    """One ReduceScatter per shard bucket, all at the optimizer step: none at ``zero_grad``."""
    plan = parallel.optimizer_plan
    assert plan is not None
    shard_buckets = sum(b.kind == "shard" for b in plan.buckets)
    assert shard_buckets > 0
    assert rec.count("ReduceScatter") == rec.count("ReduceScatter", "step") == shard_buckets, (
        rec.summary()
    )


def cloned(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.clone()


def two_backwards(
    call: Callable[[torch.Tensor], torch.Tensor],
    zero: Callable[[], None],
    opt: torch.optim.Optimizer,
    a: torch.Tensor,
    b: torch.Tensor,
) -> None:
    """A backward whose gradients `zero` discards, a second one, the step."""
    call(a).pow(2).mean().backward()
    zero()
    call(b).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("owner", ["optimizer", "module"])
def test_zero_grad_discards_the_held_gradients(owner: str, set_to_none: bool) -> None:
    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref(X1).pow(2).mean().backward()
    (ref_opt if owner == "optimizer" else ref).zero_grad(set_to_none=set_to_none)
    zeroed = {n: cloned(p.grad) for n, p in ref.named_parameters()}
    ref(X2).pow(2).mean().backward()
    ref_opt.step()
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level="level1")
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        seen: dict[str, Any] = {}

        def zero() -> None:
            (opt if owner == "optimizer" else net).zero_grad(set_to_none=set_to_none)
            seen.update({n: cloned(p.grad) for n, p in net.named_parameters()})

        with CommRecorder() as rec:
            two_backwards(parallel, zero, opt, world.rows(X1), world.rows(X2))
        reduce_scatters_only_at_the_step(parallel, rec)
        for name, grad in zeroed.items():  # (None, or zeros of the shard's shape)
            if grad is None:
                assert seen[name] is None, name
            else:
                want = shard_rows(parallel, name, grad)
                assert_matches_single_device(seen[name], want, what=f"{name}.grad after zero_grad")
        for name, p in ref.named_parameters():
            want = shard_rows(parallel, name, p.detach())
            assert_matches_single_device(net.get_parameter(name).detach(), want, what=name)


def gan_step(
    gen: Any, disc: Any, gen_opt: Any, disc_opt: Any, real: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A standard GAN step: the generator's loss runs backward through the discriminator,
    whose gradients the next step's ``disc_opt.zero_grad()`` discards."""
    bce = nn.BCEWithLogitsLoss()
    fake = gen(z)
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    d_loss = bce(disc(real), ones) + bce(disc(fake.detach()), zeros)
    disc_opt.zero_grad()
    d_loss.backward()
    disc_opt.step()
    g_loss = bce(disc(fake), ones)
    gen_opt.zero_grad()
    g_loss.backward()
    gen_opt.step()
    return d_loss.detach(), g_loss.detach()


def gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return gen, disc


def optimizers(gen: nn.Module, disc: nn.Module) -> tuple[Any, Any]:
    return (
        torch.optim.Adam(gen.parameters(), lr=1e-2, eps=1e-6),
        torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9),
    )


def test_gan_module_form_level1_trains_as_one_device() -> None:
    gen, disc = gan()
    ref_opts = optimizers(gen, disc)
    want = []
    for real, z in GAN_DATA:
        gan_step(gen, disc, *ref_opts, real, z)
        want.append(
            {
                net: {n: p.detach().clone() for n, p in ref.named_parameters()}
                for net, ref in (("gen", gen), ("disc", disc))
            }
        )
    gen2, disc2 = gan()
    with simulated_world(2) as world:
        world.replicate(gen2)
        world.replicate(disc2)
        wrapped = []
        for net in (gen2, disc2):
            parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
            wrapped.append(parallel.hsdp(threshold=0, optimizer_level="level1"))
        opts = optimizers(gen2, disc2)
        for i, (real, z) in enumerate(GAN_DATA):
            with CommRecorder() as rec:
                gan_step(*wrapped, *opts, world.rows(real), world.rows(z))
            for parallel, key, net in ((wrapped[0], "gen", gen2), (wrapped[1], "disc", disc2)):
                for name, full in want[i][key].items():
                    rows = shard_rows(parallel, name, full)
                    got = net.get_parameter(name).detach()
                    assert_matches_single_device(got, rows, what=f"step {i} {key} {name}")
            shard_buckets = sum(
                b.kind == "shard"
                for parallel in wrapped
                for b in (parallel.optimizer_plan.buckets if parallel.optimizer_plan else ())
            )
            assert rec.count("ReduceScatter") == rec.count("ReduceScatter", "step")
            assert rec.count("ReduceScatter") == shard_buckets, rec.summary()
