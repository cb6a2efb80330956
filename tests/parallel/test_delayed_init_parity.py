"""Delayed init under `AutoParallel`: seed 003's network built inside ``sw.no_init_parameters()``.

The network (seed 003's strategies, `sw.Parameter(sw.initializer("normal", ...))` weights) and its
SGD optimizer are built inside the block after ``torch.manual_seed(SEED)``; on 8 simulated ranks
AutoParallel's first call materializes each rank's blocks only. Against the single-device network
built eagerly after the same seed: every rank's block of every parameter before the first step
(parity from step 0), the 3 losses, and the blocks and gradients after each step (1e-5 relative).
The optimizer built inside the block steps the materialized parameters. Also
``parallel_mode="data_parallel"`` on 2 simulated ranks (an MLP, its optimizer built inside or
after the block): losses and parameters after each step equal the eager run's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.layout import TensorLayout
from shardwise.parallel import AutoParallel
from shardwise.parameter import is_deferred
from shardwise.planner import ParallelPlan
from shardwise.testing import assert_matches_single_device, simulated_world

WORLD, BATCH, STEPS, LR, SEED = 8, 32, 3, 0.5, 1234


sys.path.insert(0, str(Path(__file__).parent))
from test_seed003_parity import Network as Seed003  # noqa: E402  (seed 003's network, shared)
from test_seed003_parity import train_single  # noqa: E402


def Network(layouts: bool = False) -> Seed003:
    """Seed 003's network with the seed's ``sw.initializer("normal", ...)`` weights."""
    return Seed003(layouts, initializer=True)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


State = dict[str, torch.Tensor]


def single_device(layouts: bool) -> tuple[State, list[float], list[State]]:
    """Initial parameters; losses and parameters + gradients after each backward."""
    torch.manual_seed(SEED)
    net = Network(layouts)
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    losses, states = train_single(net, data(), LR)
    return initial, losses, states


def blocks(full: torch.Tensor, layout: TensorLayout) -> Callable[[int], torch.Tensor]:
    return lambda r: full[layout.local_slice(r, full.shape)]


def check_blocks(net: Seed003, plan: ParallelPlan, state: State, grads: bool = True) -> None:
    for name, p in net.named_parameters():
        layout, shape = plan.param_layouts()[name]
        assert tuple(state[name].shape) == shape
        assert_matches_single_device(p.detach(), blocks(state[name], layout), what=name)
        if grads:
            assert p.grad is not None
            grad = blocks(state[f"{name}.grad"], layout)
            assert_matches_single_device(p.grad, grad, what=f"{name}.grad")


@pytest.mark.parametrize("layouts", [False, True], ids=["int", "layout"])
def test_delayed_init_matches_single_device_from_step_0(layouts: bool) -> None:
    initial, losses, states = single_device(layouts)
    torch.manual_seed(SEED)
    with sw.no_init_parameters():
        net = Network(layouts)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
    assert all(is_deferred(p) for p in net.parameters())
    batches = data()  # made outside the world (inside, random factories draw per rank)
    with simulated_world(WORLD) as world:
        parallel = AutoParallel(net)
        plan = parallel.plan(world.rows(batches[0][0]))
        assert not any(p.is_meta for p in net.parameters())
        check_blocks(net, plan, initial, grads=False)  # parity from step 0
        for step, (x, y) in enumerate(batches):
            logits = parallel(world.rows(x))
            loss = sw.ops.AllReduce()(F.cross_entropy(logits, world.rows(y))) / WORLD
            loss.backward()
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            check_blocks(net, plan, states[step])
            opt.step()  # the optimizer built inside no_init_parameters
            opt.zero_grad()
        last = states[-1]
        after = {n: last[n] - LR * last[f"{n}.grad"] for n in plan.params}
        check_blocks(net, plan, after, grads=False)  # the last update


def test_local_blocks_only_and_unconsumed_parameters_whole() -> None:
    """Each rank holds its planned block shape; a parameter no primitive consumes and a buffer
    (both unplanned) are materialized whole, equal to the eager values."""
    torch.manual_seed(SEED)
    eager = Network()
    eager.extra = sw.Parameter(sw.initializer("normal", [3, 5]))
    eager.register_buffer("stat", torch.randn(4))
    extra = torch.Tensor(eager.get_parameter("extra").detach()).clone()
    stat = eager.get_buffer("stat").clone()
    torch.manual_seed(SEED)
    with sw.no_init_parameters():
        net = Network()
        net.extra = sw.Parameter(sw.initializer("normal", [3, 5]))
        net.register_buffer("stat", torch.randn(4))
    x = data()[0][0]
    with simulated_world(WORLD) as world:
        parallel = AutoParallel(net)
        plan = parallel.plan(world.rows(x))
        assert set(plan.params) == {"fc1_weight", "fc2_weight", "fc3_weight", "extra"}
        assert not plan.params["extra"].layout.used_axes()  # unconsumed: stored whole
        for name, (layout, shape) in plan.param_layouts().items():
            assert tuple(getattr(net, name).shape) == tuple(layout.local_shape(shape))
        assert tuple(net.fc1_weight.shape) == (196, 512)
        got_extra, got_stat = net.get_parameter("extra").detach(), net.get_buffer("stat")
        assert_matches_single_device(got_extra, extra, what="extra")
        assert_matches_single_device(got_stat, stat, what="stat")


def test_tied_weights_stay_tied_gpt2() -> None:
    """nanoGPT ties ``lm_head.weight`` to ``transformer.wte.weight``: built inside the block on
    simulated ranks (each rank's value a new Parameter object), both modules get the same new
    Parameter, and the losses equal the eagerly built network's."""
    from shardwise.testing.nanogpt import GPT2

    cfg = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "block_size": 16}
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))

    def losses(deferred: bool) -> list[float]:
        with simulated_world(2):
            sw.set_seed(1)
            if deferred:
                with sw.no_init_parameters():
                    net = GPT2(**cfg)
                    opt = net.configure_optimizers(weight_decay=0.1, lr=6e-4)
            else:
                net = GPT2(**cfg)
                opt = net.configure_optimizers(weight_decay=0.1, lr=6e-4)

            def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                _, loss = net(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss

            parallel = AutoParallel(step, parallel_mode="semi_auto")
            out = [float(parallel(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
                   for _ in range(2)]  # fmt: skip
            assert net.lm_head.weight is net.transformer.wte.weight
            return out

    assert losses(True) == losses(False)


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("where", ["inside", "after"], ids=["opt-in-block", "opt-after-block"])
def test_data_parallel_mode_on_simulated_ranks(where: str) -> None:
    """``parallel_mode="data_parallel"`` on a network built in the block failed its first call on
    simulated ranks (the per-rank values could not take over the Parameter objects); it now
    trains as the eager network does: 2 ranks, 2 SGD steps (momentum), losses and parameters."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))]
    batches.append((torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)))
    torch.manual_seed(SEED)
    eager = _mlp()
    eager_opt = torch.optim.SGD(eager.parameters(), lr=LR, momentum=0.9)
    want_losses, want_params = [], []
    for x, y in batches:
        loss = F.cross_entropy(eager(x), y)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        want_losses.append(loss.detach())
        want_params.append({n: p.detach().clone() for n, p in eager.named_parameters()})
    torch.manual_seed(SEED)
    with sw.no_init_parameters():
        net = _mlp()
        if where == "inside":
            opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    if where == "after":
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with simulated_world(2) as world:
        parallel = AutoParallel(step, parallel_mode="data_parallel")
        for i, (x, y) in enumerate(batches):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want_losses[i], what=f"loss {i}")
            params = dict(net.named_parameters())
            assert_matches_single_device(params, want_params[i], what=f"step {i}")
