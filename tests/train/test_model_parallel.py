"""`Model.train` follows `set_auto_parallel_context`, as MindSpore's Model does (seed 002).

On 8 simulated ranks, with ``AUTO_PARALLEL`` + ``search_mode="sharding_propagation"``, `Model`
runs its train step through `AutoParallel`: the strategies are the seed's, every step's loss
(what LossMonitor prints) equals one device's on the global batch, and the collectives are the
planned ones. A `grad_reducer` with a parallel mode and `eval` after parallel training that left
blocks in the parameters are refused with the fix (with whole parameters `eval` runs);
``STAND_ALONE`` (the default) keeps the plain loop.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..planner.test_propagate import Seed002

STEPS, LR, MOMENTUM = 3, 0.2, 0.1


@pytest.fixture
def propagation() -> Iterator[None]:
    sw.set_auto_parallel_context(
        parallel_mode=sw.ParallelMode.AUTO_PARALLEL,
        search_mode="sharding_propagation",
        dataset_strategy="data_parallel",
    )
    yield
    sw.reset_auto_parallel_context()


class Losses(sw.train.Callback):
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
        self.seen.append(ctx.net_outputs)


def _batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.rand(rows, 32, generator=g), torch.rand(rows, 16, generator=g))] * STEPS


def _single(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    net = Seed002()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    out = []
    for x, y in batches:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.detach())
    return out


@pytest.mark.usefixtures("propagation")
def test_model_trains_seed002_under_sharding_propagation() -> None:
    batches = _batches(16)  # 2 rows per rank
    want = _single(batches)
    net = Seed002()
    losses = Losses()
    with simulated_world(8) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        model = sw.Model(net, torch.nn.MSELoss(), opt)
        data = [(world.rows(x), world.rows(y)) for x, y in batches]
        with CommRecorder() as rec:
            model.train(1, data, callbacks=[losses])
        for s, loss in enumerate(losses.seen):
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
    assert model.parallel is not None
    assert model.parallel.parallel_mode == "sharding_propagation"
    assert model.parallel.strategies()["relu/ReLU"] == ((2, 4),)
    assert model.parallel.strategies()["matmul2/MatMul"] == ((2, 4), (4, 1))
    # per step, forward: matmul's and matmul2's AllReduce over 0-1-2-3, the loss's over all 8
    assert rec.count("AllReduce", "forward") == 3 * STEPS, rec.summary()
    model.metrics = {"accuracy": sw.train.Accuracy}
    with pytest.raises(ValueError, match="blocks or optimizer-parallel shards; evaluate through"):
        model.eval(data)  # (its matmuls' weights are this rank's blocks)


def _plain() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))


@pytest.mark.parametrize(
    "mode", [sw.ParallelMode.SEMI_AUTO_PARALLEL, sw.ParallelMode.DATA_PARALLEL]
)
def test_eval_after_parallel_training_with_whole_parameters(mode: str) -> None:
    """Nothing annotated (semi_auto) or data_parallel mode: every parameter stays whole, so
    `eval` after `train` runs and equals one device's (it was refused for every parallel mode)."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 16, (8,), generator=g)
    one, net = _plain(), _plain()
    sw.Model(one, torch.nn.CrossEntropyLoss(), torch.optim.SGD(one.parameters(), lr=LR)).train(
        1, [(x, y)]
    )
    want = sw.Model(one, torch.nn.CrossEntropyLoss(), metrics={"accuracy", "loss"}).eval([(x, y)])
    sw.set_auto_parallel_context(parallel_mode=mode, dataset_strategy="full_batch")
    try:
        with simulated_world(2) as world:
            world.replicate(net)
            opt = torch.optim.SGD(net.parameters(), lr=LR)
            model = sw.Model(net, torch.nn.CrossEntropyLoss(), opt, metrics={"accuracy", "loss"})
            model.train(1, [(world.same(x), world.same(y))])
            assert model.parallel is not None and not model.parallel.holds_blocks
            got = model.eval([(world.same(x), world.same(y))])
    finally:
        sw.reset_auto_parallel_context()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5), k


@pytest.mark.usefixtures("propagation")
def test_grad_reducer_with_a_parallel_mode_is_refused() -> None:
    net = Seed002()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        model = sw.Model(net, torch.nn.MSELoss(), opt, grad_reducer=lambda: None)
        with pytest.raises(ValueError, match="drop grad_reducer"):
            model.train(1, [(torch.zeros(2, 32), torch.zeros(2, 16))])


def test_stand_alone_runs_the_plain_loop() -> None:
    net = Seed002()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        model = sw.Model(net, torch.nn.MSELoss(), opt)
        model.train(1, [(torch.zeros(2, 32), torch.zeros(2, 16))])
    assert model.parallel is None


@pytest.mark.parametrize("context", [False, True], ids=["stand_alone", "auto_parallel"])
def test_model_over_a_module_form_wrapper_reports_the_global_loss(
    context: bool, request: pytest.FixtureRequest
) -> None:
    """`Model(sw.AutoParallel(net), loss_fn, opt)`: the loss is computed outside the wrapper,
    on this rank's rows of its outputs; the step's loss (what LossMonitor prints) is the mean of
    the ranks' losses, one device's on the global batch, on every rank (it was each rank's own,
    and a simulated world failed turning it into a float). Under a parallel context the wrapper
    runs as given (it was wrapped in a train-step AutoParallel of its own)."""
    if context:
        request.getfixturevalue("propagation")
    batches = _batches(16)
    want = _single(batches)
    net = Seed002()
    losses = Losses()
    with simulated_world(8) as world:
        world.replicate(net)
        wrapper = sw.AutoParallel(net, parallel_mode="sharding_propagation")
        opt = torch.optim.SGD(wrapper.parameters(), lr=LR, momentum=MOMENTUM)
        model = sw.Model(wrapper, torch.nn.MSELoss(), opt)
        data = [(world.rows(x), world.rows(y)) for x, y in batches]
        model.train(1, data, callbacks=[losses, sw.train.LossMonitor()])
        for s, loss in enumerate(losses.seen):
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
    assert model.parallel is None
    with pytest.raises(ValueError, match="the network is an AutoParallel, which reduces"):
        sw.Model(wrapper, torch.nn.MSELoss(), opt, grad_reducer=lambda: None)
