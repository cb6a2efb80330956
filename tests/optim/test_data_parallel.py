"""`DataParallelRunner` (data-parallel mode, seed 001's optimizer parallel), simulated ranks.

Seed 000's MNIST-shaped MLP, 5 global batches of 32 made outside the world: on 2, 4 and 8 ranks
the averaged losses and the parameters after every step equal the single-device run for SGD,
SGD + momentum, Adam and AdamW, each with and without ``parallel_optimizer=True`` (`PAIRWISE`:
every world size and every optimizer meets both). Also: the exact
AllReduce / Broadcast counts per step with fusion ids 0/1/2 per layer, the owners and the
per-rank optimizer state the plan implies, the module form, hook removal, bad inputs.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.optim import DataParallelRunner
from shardwise.optim._data_parallel_plan import assign_owners
from shardwise.optim._data_parallel_steps import local_rows
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

STEPS, BATCH = 5, 32
ONES = torch.ones(4, 4)
MakeOpt = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, MakeOpt] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    # Adam normalizes every gradient element: with lr 1e-3 / eps 1e-8 the float32 rounding of
    # a split batch (the sum of per-rank gradients vs one matmul) already moves parameters by up
    # to 3e-4 in plain torch, so a smaller step and eps keep the runs comparable at 1e-5
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4, eps=1e-6),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, eps=1e-6, weight_decay=0.01),
}


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def single_device(make_opt: MakeOpt) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Losses and the parameters after each step."""
    net, loss_fn = make_net(), nn.CrossEntropyLoss()
    opt = make_opt(net.parameters())
    losses, params = [], []
    for x, y in make_data():
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, params


def set_fusion_per_layer(net: nn.Sequential) -> None:
    """Fusion ids 0 / 1 / 2 on the three Linear layers (after `world.replicate`)."""
    for layer, fusion_id in zip((net[1], net[3], net[5]), (0, 1, 2), strict=True):
        sw.set_comm_fusion(layer, fusion_id)


def run_parallel(
    world_size: int,
    make_opt: MakeOpt,
    parallel_optimizer: bool,
    check: Callable[[int, Any, nn.Module], None],
    **kw: Any,
) -> tuple[DataParallelRunner, CommRecorder]:
    """Train 5 steps on `world_size` simulated ranks; `check(step, loss, net)` after each."""
    batches, net = make_data(), make_net()
    with simulated_world(world_size) as world, CommRecorder() as rec:
        world.replicate(net)
        set_fusion_per_layer(net)
        optimizer = make_opt(net.parameters())
        loss_fn = nn.CrossEntropyLoss()

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = loss_fn(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        runner = DataParallelRunner(
            net,
            [optimizer],
            train_step=train_step,
            parallel_optimizer=parallel_optimizer,
            **kw,
        )
        for step, (x, y) in enumerate(batches):
            check(step, runner(world.rows(x), world.rows(y)), net)
    return runner, rec


# every world size with every optimizer; optimizer parallel on and off alternating, so that each
# world size and each optimizer runs with both (12 runs instead of 24)
PAIRWISE = [
    pytest.param(world, name, (i + j) % 2 == 1, id=f"{world}-{name}-{('dp', 'op')[(i + j) % 2]}")
    for i, world in enumerate([2, 4, 8])
    for j, name in enumerate(OPTIMIZERS)
]


@pytest.mark.parametrize(("world_size", "opt_name", "parallel_optimizer"), PAIRWISE)
def test_matches_single_device(world_size: int, opt_name: str, parallel_optimizer: bool) -> None:
    make_opt = OPTIMIZERS[opt_name]
    losses, params = single_device(make_opt)

    def check(step: int, loss: Any, net: nn.Module) -> None:
        assert_matches_single_device(loss, losses[step], what=f"loss {step}")
        got = {n: p.detach() for n, p in net.named_parameters()}
        assert_matches_single_device(got, params[step], what=f"params after step {step}")

    # threshold 0: every parameter gets an owner (on 8 ranks, two ranks own nothing)
    runner, _ = run_parallel(world_size, make_opt, parallel_optimizer, check, threshold_kb=0)
    assert len(runner.owners) == (6 if parallel_optimizer else 0)


# Owners of the 6 parameters (w1 1.6 MB, b1 2 KiB, w2 1 MiB, b2 2 KiB, w3 20 KiB, b3 40 B) by
# the greedy byte balance with threshold 0, and the broadcasts that follows: one per
# (owner, fusion id) bucket, fusion id 0 (layer 1) one per parameter.
OWNERS = {
    2: [0, 1, 1, 1, 1, 1],  # rank 0: w1; rank 1: the rest -> w1 | b1 | w2+b2 | w3+b3
    4: [0, 1, 2, 3, 1, 3],  # w1 | b1 | w2 | b2 | w3 | b3
    8: [0, 1, 2, 3, 4, 5],  # ranks 6 and 7 own nothing
}
BROADCASTS = {2: 4, 4: 6, 8: 6}


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_exact_collectives_per_step(world_size: int) -> None:
    names = ["1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    runner, rec = run_parallel(
        world_size, OPTIMIZERS["adam"], True, lambda *a: None, threshold_kb=0
    )
    assert runner.owners == dict(zip(names, OWNERS[world_size], strict=True))
    group = tuple(range(world_size))
    # gradients: layer 1 (fusion 0) one per parameter = 2, layer 3 (fusion 1) 1, layer 5
    # (fusion 2) 1, in the optimizer step; plus the loss: 5 AllReduce per step
    assert rec.kinds() == Counter(
        {
            ("AllReduce", "forward", group): 1 * STEPS,
            ("AllReduce", "step", group): 4 * STEPS,
            ("Broadcast", "step", group): BROADCASTS[world_size] * STEPS,
        }
    )
    assert runner.collectives_per_step() == {
        "AllReduce": 5,
        "Broadcast": BROADCASTS[world_size],
    }
    # the fused buckets carry every element once per step, and per parameter three counts
    # (the ranks that had a gradient, a sparse one, its sparse dims: the same buffer on every
    # rank whichever parameters its rows used)
    reduced = sum(r.numel for r in rec.select("AllReduce")) // STEPS
    total = sum(p.numel() for p in make_net().parameters())
    assert reduced == total + 3 * len(names) + 1  # + the loss
    assert sum(r.numel for r in rec.select("Broadcast")) // STEPS == total


def test_default_threshold_and_no_fusion() -> None:
    # 64 KiB threshold: only the two big weights get owners; the rest is updated everywhere
    runner, rec = run_parallel(4, OPTIMIZERS["sgd"], True, lambda *a: None)
    assert runner.owners == {"1.weight": 0, "3.weight": 1}
    assert rec.count("Broadcast") == 2 * STEPS
    # fusion off: one all-reduce per parameter (+ loss), one broadcast per owned parameter
    runner, rec = run_parallel(
        2, OPTIMIZERS["sgd"], True, lambda *a: None, threshold_kb=0, fusion={"openstate": False}
    )
    assert rec.count("AllReduce") == 7 * STEPS and rec.count("Broadcast") == 6 * STEPS
    # size mode: 64 MiB buckets hold the whole network
    runner, rec = run_parallel(
        2, OPTIMIZERS["sgd"], False, lambda *a: None, fusion={"allreduce": {"mode": "auto"}}
    )
    assert rec.count("AllReduce") == 2 * STEPS and rec.count("Broadcast") == 0
    # index mode: a new bucket at network parameters 2 and 4 (one per layer), + the loss
    index = {"allreduce": {"mode": "index", "config": [2, 4]}}
    runner, rec = run_parallel(2, OPTIMIZERS["sgd"], False, lambda *a: None, fusion=index)
    assert rec.count("AllReduce") == 4 * STEPS
    assert [len(b.entries) for b in runner._grad_buckets[0]] == [2, 2, 2]


def test_per_rank_state_is_the_owned_share() -> None:
    """Adam keeps exp_avg and exp_avg_sq (plus a step) per updated parameter: with
    optimizer parallel each rank's share is its owned parameters' (the real-process test
    checks the optimizer state itself; one simulated optimizer object serves all ranks)."""
    runner, _ = run_parallel(4, OPTIMIZERS["adam"], True, lambda *a: None, threshold_kb=0)
    sizes = {e.name: e.nbytes for e in runner.entries}
    per_rank = [sum(sizes[n] for n in runner.owned(r)) for r in range(4)]
    assert sum(per_rank) == sum(sizes.values())  # every parameter updated exactly once
    assert per_rank == [
        sizes["1.weight"],
        sizes["1.bias"] + sizes["5.weight"],
        sizes["3.weight"],
        sizes["3.bias"] + sizes["5.bias"],
    ]
    assert max(per_rank) < sum(sizes.values()) * 0.7
    plan = str(runner)
    assert "1.weight" in plan and "per step: 5 AllReduce, 6 Broadcast" in plan
    # not assigned parameters are updated by every rank
    runner, _ = run_parallel(2, OPTIMIZERS["adam"], True, lambda *a: None)
    assert runner.owned(1) == ["1.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    assert "all" in str(runner)


def _steps_match(
    forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    opt: torch.optim.Optimizer,
    net: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    params: list[dict[str, torch.Tensor]],
) -> None:
    """Each global batch: `forward` gives this rank's logits and labels; after the backward and
    the step, `net`'s parameters equal one device's after that step (`params`)."""
    loss_fn = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(batches):
        loss_fn(*forward(x, y)).backward()
        opt.step()
        opt.zero_grad()
        assert_matches_single_device(
            {n: p.detach() for n, p in net.named_parameters()}, params[step]
        )


def test_module_form_reduces_at_step() -> None:
    make_opt = OPTIMIZERS["momentum"]
    _, params = single_device(make_opt)
    batches, net = make_data(), make_net()
    with simulated_world(4) as world, CommRecorder() as rec:
        world.replicate(net)
        opt = make_opt(net.parameters())
        runner = DataParallelRunner(net, [opt], parallel_optimizer=True, threshold_kb=0)

        def rows(x: torch.Tensor) -> torch.Tensor:
            return world.rank_map(lambda r: x[r * 8 : (r + 1) * 8].clone())

        _steps_match(lambda x, y: (runner(rows(x)), rows(y)), opt, net, batches, params)
        # default fusion id 1 everywhere: one all-reduce per step, no loss reduction
        assert rec.count("AllReduce") == STEPS
        assert runner.collectives_per_step()["AllReduce"] == 1


def test_module_form_adopts_an_optimizer_built_after_the_wrapper() -> None:
    """``AutoParallel(net, parallel_mode="data_parallel")`` with the optimizer built after it,
    as docs/parallel.md orders: its gradients are averaged from its first step (they never
    were: each rank drifted on its own rows, silently); an optimizer over other parameters is
    left alone."""
    make_opt = OPTIMIZERS["momentum"]
    _, params = single_device(make_opt)
    batches, net, other = make_data(), make_net(), nn.Linear(2, 2)
    with simulated_world(4) as world, CommRecorder() as rec:
        world.replicate(net)
        world.replicate(other)
        parallel = sw.AutoParallel(net, parallel_mode="data_parallel")
        opt = make_opt(net.parameters())
        unrelated = torch.optim.SGD(other.parameters(), lr=0.1)
        _steps_match(
            lambda x, y: (parallel(world.rows(x)), world.rows(y)), opt, net, batches, params
        )
        assert rec.count("AllReduce") == STEPS
        other(torch.ones(1, 2)).sum().backward()
        unrelated.step()
        assert rec.count("AllReduce") == STEPS


def test_remove_and_garbage_collection() -> None:
    net, x = nn.Linear(4, 2), torch.ones(2, 4)
    with simulated_world(2) as world, CommRecorder() as rec:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        runner = DataParallelRunner(net, [opt])
        net(world.same(x)).sum().backward()
        opt.step()
        assert rec.count("AllReduce") == 1
        runner.remove()
        opt.step()
        assert rec.count("AllReduce") == 1
        runner = DataParallelRunner(net, [opt])
        del runner
        gc.collect()
        opt.step()
        assert rec.count("AllReduce") == 1  # (the collected runner's hooks do nothing)
        # (they go at the next registration, not mid-step: tests/optim/test_global_hooks.py)
        DataParallelRunner(net, [opt]).remove()
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        runner = DataParallelRunner(net, [opt])
        runner.remove()  # (an optimizer built after it is not adopted: every hook went)
        later = torch.optim.SGD(net.parameters(), lr=0.1)
        later.step()
        assert runner.optimizers == [opt] and not later._optimizer_step_pre_hooks


def test_finds_optimizer_in_train_step() -> None:
    net = nn.Linear(4, 2)
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = net(x).sum()
            loss.backward()
            opt.step()
            return loss

        runner = DataParallelRunner(net, [], train_step=step, parallel_optimizer=True)
        assert runner.optimizers == [opt]


def test_an_optimizer_the_step_keeps_in_a_dict_is_adopted_at_its_first_step() -> None:
    """A train step's optimizer the wrapper cannot see (kept in a dict) and stepped first in a
    later call (a head updated every other call) had its update use each rank's own gradient,
    silently (the step check runs on the first calls only); it is adopted at its first step.
    With ``hsdp()`` (``parallel_optimizer=True``: owners planned once) it is a ValueError."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 12, generator=g), torch.randint(0, 8, (16,), generator=g))
            for _ in range(4)]  # fmt: skip

    def run(net: nn.Sequential, wrap: Callable[[Any], Any], feed: Callable[..., Any]) -> None:
        body = torch.optim.SGD(net[0].parameters(), lr=0.1)
        kept = {"head": torch.optim.SGD(net[2].parameters(), lr=0.1), "calls": 0}

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            body.step()
            body.zero_grad()
            if kept["calls"] % 2:
                kept["head"].step()
                kept["head"].zero_grad()
            kept["calls"] += 1
            return loss

        call = wrap(step)
        for x, y in data:
            call(*feed(x, y))

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 8))

    ref = build()
    run(ref, lambda f: f, lambda x, y: (x, y))
    for parallel_optimizer in (False, True):
        net = build()
        with simulated_world(4) as world:
            world.replicate(net)

            def wrap(f: Any, po: bool = parallel_optimizer) -> Any:
                parallel = sw.AutoParallel(f, parallel_mode="data_parallel")
                return parallel.hsdp(threshold=0) if po else parallel

            def feed(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return world.rows(x), world.rows(y)

            if parallel_optimizer:
                with pytest.raises(ValueError, match="a SGD the wrapper was not given steps"):
                    run(net, wrap, feed)
                continue
            run(net, wrap, feed)
            assert_matches_single_device(
                {n: p.detach() for n, p in net.named_parameters()},
                {n: p.detach() for n, p in ref.named_parameters()},
            )


def test_helpers() -> None:
    assert assign_owners([400, None, 300, 200, 100], 2) == [0, None, 1, 1, 0]
    assert assign_owners([1, 1], 4) == [0, 1]
    x = torch.arange(8).view(4, 2)
    assert local_rows(x, 2, 1).tolist() == [[4, 5], [6, 7]]
    assert local_rows(3, 2, 1) == 3


def test_bad_inputs() -> None:
    net = nn.Linear(4, 2)
    other, odd = nn.Linear(4, 2), torch.ones(3, 4)
    with pytest.raises(RuntimeError, match=r"init\(\) first"):
        DataParallelRunner(net, [])
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="threshold_kb=-1"):
            DataParallelRunner(net, [opt], threshold_kb=-1)
        with pytest.raises(ValueError, match=r"\.hsdp\(\), or parallel_optimizer=True\) needs"):
            DataParallelRunner(net, [], parallel_optimizer=True)
        with pytest.raises(ValueError, match="none was passed or found in the train step's code"):
            DataParallelRunner(net, [], train_step=lambda x: x, parallel_optimizer=True)
        with pytest.raises(ValueError, match=r"AutoParallel\(\.\.\., optimizer=opt\)"):
            sw.AutoParallel(lambda x: x, network=net, parallel_mode="data_parallel").hsdp()(
                world.rows(ONES)
            )
        with pytest.raises(ValueError, match=r"optimizers\[0\].*not one of the network's"):
            DataParallelRunner(net, [torch.optim.SGD(other.parameters(), lr=0.1)])
        for hsdp in (False, True):  # (sharing some parameters; with hsdp, any)
            with pytest.raises(ValueError, match="held by optimizers"):
                DataParallelRunner(
                    net, [opt, torch.optim.SGD([net.weight], lr=0.1)], parallel_optimizer=hsdp
                )
        with pytest.raises(TypeError, match=r"optimizers\[0\] is a Linear"):
            DataParallelRunner(net, [other])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="network must be"):
            DataParallelRunner(opt, [opt])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="parallel_optimizer=1"):
            DataParallelRunner(net, [opt], parallel_optimizer=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown key 'allreduce_mode'"):
            DataParallelRunner(net, [opt], fusion={"allreduce_mode": 1})
        with pytest.raises(ValueError, match="mode"):
            DataParallelRunner(net, [opt], fusion={"allreduce": {"mode": "bucket"}})
        runner = DataParallelRunner(
            net, [opt], train_step=lambda x: net(x).sum(), dataset_strategy="full_batch"
        )
        with pytest.raises(
            ValueError,
            match=r"'full_batch' .*shape \[3, 4\].*not divisible by "
            r"the 2 ranks.*'data_parallel' \(each rank passes its own rows\)",
        ):
            runner(world.same(odd))
        with pytest.raises(ValueError, match="per-input strategies need parallel_mode='semi_auto'"):
            DataParallelRunner(net, [opt], dataset_strategy=((2, 1),))
        runner.remove()


def test_returned_scalars_in_a_dict_are_the_global_mean() -> None:
    """``parallel_mode="data_parallel"``: a step returning ``{"loss": loss, "parts": (...)}``
    gets the loss averaged over the ranks as a bare loss is (it was each rank's own, silently);
    an int count stays this rank's."""
    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    want = nn.functional.cross_entropy(net(x), y).detach()
    hits = (net(x).argmax(-1) == y).reshape(2, 4).sum(1).tolist()  # (each rank's own rows)
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            count = (net(x).argmax(-1) == y).sum()
            return {"loss": loss, "parts": (2 * loss, count), "rows": x.shape[0]}

        out = sw.AutoParallel(step, parallel_mode="data_parallel")(world.rows(x), world.rows(y))
        assert_matches_single_device(out["loss"], want, what="loss")
        assert_matches_single_device(out["parts"][0], 2 * want, what="2 * loss")
        assert [c.item() for c in world.local_tensors(out["parts"][1])] == hits
        assert out["rows"] == 4
