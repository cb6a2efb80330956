"""A ``torch.amp.GradScaler`` sees every rank's overflow under model parallel.

Each rank's scaler checks the gradients it holds for inf/NaN. Under Megatron's layout those
are its blocks, so an overflow in one rank's block went unseen by the others: that rank
skipped its optimizer step and halved its scale, the others stepped (the ranks' parameters and
scales drifted apart, against one device, which skips). The check's verdict is now the
maximum over the ranks (`_torch/grad_scaler.agree_on_overflow`, one AllReduce(MAX) of a scalar
per check; none under semi_auto data parallel, where every rank holds the whole reduced
gradients). ``parallel_mode="data_parallel"``, whose scaler checks each rank's own gradients
before the step averages them, gets the same verdict.
"""

from __future__ import annotations

import functools
import types
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

STEPS = 3  # (each loss after the first depends on whether the steps before were skipped)


def make() -> nn.Sequential:
    """Rows 0-7 of the first weight are zero (tanh(0) = 0: the output does not depend on the
    second weight's columns 0-7), and those columns are huge: the scaled gradient of the first
    weight's rows 0-7 overflows float16, the rest stays finite."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    with torch.no_grad():
        net[0].weight[:8] = 0.0
        net[0].bias[:8] = 0.0
        net[2].weight[:, :8] = 1e4
    return net


def body(
    net: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, x: torch.Tensor
) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss


def train(net: nn.Module, scaler: torch.amp.GradScaler, how: str = "closure") -> object:
    """The train step, reaching the scaler through a closure, as a partial's argument, or
    kept in a dict, a list or a config object's attribute (the capture must leave its lazily
    made scale real, and the overflow check must be agreed for it too)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if how == "partial":
        return functools.partial(body, net, opt, scaler)
    amp = {"scaler": scaler}
    scalers = [scaler]
    cfg = types.SimpleNamespace(amp=types.SimpleNamespace(scaler=scaler))

    def step(x: torch.Tensor) -> torch.Tensor:
        return body(net, opt, scaler, x)

    def in_dict(x: torch.Tensor) -> torch.Tensor:
        return body(net, opt, amp["scaler"], x)

    def in_list(x: torch.Tensor) -> torch.Tensor:
        return body(net, opt, scalers[0], x)

    def nested(x: torch.Tensor) -> torch.Tensor:
        return body(net, opt, cfg.amp.scaler, x)

    trainer = nn.Module()
    trainer.scaler = scaler  # (a plain attribute of a module: not a submodule or parameter)
    trainers = [trainer]

    def on_module(x: torch.Tensor) -> torch.Tensor:
        return body(net, opt, trainers[0].scaler, x)

    ways = {"dict": in_dict, "list": in_list, "nested": nested, "module": on_module}
    return ways.get(how, step)


@pytest.mark.parametrize("how", ["closure", "partial", "dict", "list", "nested", "module"])
def test_an_overflow_in_one_ranks_block_skips_the_step_on_every_rank(how: str) -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    single, single_scaler = make(), torch.amp.GradScaler("cpu")
    step = train(single, single_scaler)
    want = [step(x).detach() for _ in range(STEPS)]  # type: ignore[operator]
    assert single_scaler.get_scale() == 2.0**16 / 2**STEPS  # (every step skipped)
    net, scaler = make(), torch.amp.GradScaler("cpu")
    with simulated_world(4) as world:
        world.replicate(net)
        sw.shard(net[0], in_strategy=((2, 1), (2, 1)))  # (rows 0-7 of its weight: mp rank 0)
        sw.shard(net[2], in_strategy=((2, 2), (1, 2)))
        parallel = sw.AutoParallel(train(net, scaler, how))
        with CommRecorder() as rec:
            for i in range(STEPS):
                loss = parallel(world.rows(x))
                assert_matches_single_device(loss, want[i], rtol=1e-3, what=f"loss {i}")
        assert scaler.get_scale() == single_scaler.get_scale()
    checks = [r for r in rec.records if "GradScaler" in r.label]
    assert Counter((r.kind, r.numel) for r in checks) == Counter({("AllReduce", 1): STEPS})


def test_data_parallel_mode_skips_an_overflow_in_one_ranks_rows_on_every_rank() -> None:
    """``parallel_mode="data_parallel"`` averages gradients in the optimizer's step, after the
    scaler checked this rank's own: an overflow in one rank's rows made that rank alone skip
    (a collective mismatch in a real job). Its verdict is the maximum over the ranks too."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g))
            for _ in range(STEPS)]  # fmt: skip
    data[1][0][6, 0] = 1e38  # (a row of rank 1's, of 2)

    def run(net: nn.Module, wrap: object, feed: object) -> torch.amp.GradScaler:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        call = wrap(step)  # type: ignore[operator]
        for x, y in data:
            call(*feed(x, y))  # type: ignore[operator]
        return scaler

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))

    ref = build()
    want = run(ref, lambda f: f, lambda x, y: (x, y)).get_scale()
    assert want == 512.0  # (one skipped step)
    net = build()
    with simulated_world(2) as world, CommRecorder() as rec:
        world.replicate(net)
        scaler = run(
            net,
            lambda f: sw.AutoParallel(f, parallel_mode="data_parallel"),
            lambda x, y: (world.rows(x), world.rows(y)),
        )
        assert scaler.get_scale() == want
        assert_matches_single_device(
            {n: p.detach() for n, p in net.named_parameters()},
            {n: p.detach() for n, p in ref.named_parameters()},
        )
    checks = [r for r in rec.records if "GradScaler" in r.label]
    assert Counter((r.kind, r.numel) for r in checks) == Counter({("AllReduce", 1): STEPS})


def _accumulating(net: nn.Module, scaler: torch.amp.GradScaler) -> Any:
    """A train step of two micro-batches, each loss scaled by `scaler` before its backward."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for xc, yc in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = nn.functional.cross_entropy(net(xc), yc) / 2
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("how", ["data parallel", "level1", "level2", "level3", "megatron"])
def test_gradient_accumulation_with_a_scaler_matches_one_device(how: str) -> None:
    """The scaler makes its scale lazily (``torch.full``) in the first micro-batch's
    ``scale``: the plan has that op, the second micro-batch does not run it. The second pass
    raised ``UnsupportedParallelError`` ("called torch.Tensor.to where the plan has op ...
    full") on the first call; it now steps over the plan's factories it does not call."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g))
            for _ in range(STEPS)]  # fmt: skip

    def new_scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)

    ref, ref_scaler = build(), new_scaler()
    ref_step = _accumulating(ref, ref_scaler)
    want = [ref_step(x, y).detach() for x, y in data]
    net, scaler = build(), new_scaler()
    with simulated_world(4 if how == "megatron" else 2) as world:
        world.replicate(net)
        if how == "megatron":
            sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
            sw.shard(net[2], in_strategy=((2, 2), (1, 2)))
        parallel = sw.AutoParallel(_accumulating(net, scaler))
        if how.startswith("level"):
            parallel.hsdp(threshold=0, optimizer_level=how)
        for s, (x, y) in enumerate(data):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
        assert scaler.get_scale() == ref_scaler.get_scale() == 256.0 * 2**STEPS
        if how == "data parallel":  # (whole parameters on every rank)
            assert_matches_single_device(
                {n: p.detach() for n, p in net.named_parameters()},
                {n: p.detach() for n, p in ref.named_parameters()},
            )
