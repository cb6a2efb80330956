"""``torch.compile``'d code inside a wrapped call runs eagerly, under the plan.

The plan executor watches every torch-level op, so a compiled module or step (``torch.compile``
traced them into one graph of its own, under the executor's mode: dynamo failed inside its
tracer, "cls_source must not be None for MRO walk") runs eagerly while shardwise captures and
runs it (``torch.compiler.set_stance("force_eager")`` for the call). A compiled module in a train
step, a compiled train step and a compiled module wrapped itself each give one device's loss,
gradients and outputs. ``torch.compile`` of the wrapper itself (dynamo failed tracing into it:
"Attempt to trace forbidden callable set_stance") has no effect: the wrapper runs uncompiled,
with one device's results, and says so once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

# (torch's notice that shardwise's global module hooks also fire for the compiled wrapper)
pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`")


def make() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


@pytest.mark.parametrize("compiled", ["module", "step"])
def test_a_compiled_train_step_or_module_trains_as_one_device(compiled: str) -> None:
    x, y = batch()
    single = make()
    want = F.cross_entropy(single(x), y)
    want.backward()
    net = make()
    model = torch.compile(net) if compiled == "module" else net
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(torch.compile(step) if compiled == "step" else step, network=net)
        for _ in range(2):  # (planned, then run from the plan)
            net.zero_grad()
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want, what="loss")
            grads = {n: p.grad for n, p in net.named_parameters()}
            assert_matches_single_device(
                grads, {n: p.grad for n, p in single.named_parameters()}, what="grads"
            )


def test_a_compiled_module_wrapped_returns_this_ranks_rows() -> None:
    x, _ = batch()
    want = make()(x).detach()
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(torch.compile(net))
        out = parallel(world.rows(x))
        assert_matches_single_device(out, lambda rank: want.chunk(2)[rank], what="output")


@pytest.mark.parametrize("form", ["module", "step"])
def test_compiling_the_wrapper_runs_it_uncompiled_as_one_device_and_warns_once(form: str) -> None:
    x, y = batch()
    single = make()
    opt = torch.optim.SGD(single.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        loss = F.cross_entropy(single(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.detach())
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        wrapped = sw.AutoParallel(net) if form == "module" else sw.AutoParallel(step)
        parallel = torch.compile(wrapped)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(2):  # (planned, then run from the plan)
                if form == "module":  # (rows: a loss equal on every rank, as the wrapper asks)
                    loss = (
                        sw.ops.AllReduce()(F.cross_entropy(parallel(world.rows(x)), world.rows(y)))
                        / 2
                    )
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    loss = parallel(world.rows(x), world.rows(y))
                assert_matches_single_device(loss, want[i], what=f"loss {i}")
        said = [w for w in caught if "torch.compile of an AutoParallel wrapper" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in caught]
        assert "has no effect" in str(said[0].message)
        assert "call the wrapper uncompiled" in str(said[0].message)
        assert said[0].filename == __file__
    assert_matches_single_device(
        {n: p.detach() for n, p in net.named_parameters()},
        {n: p.detach() for n, p in single.named_parameters()},
        what="parameters",
    )


def test_compiling_the_wrapper_fullgraph_is_refused_with_the_fix() -> None:
    torch.compiler.reset()  # (dynamo would reuse the wrapper's call compiled without fullgraph)
    x, _ = batch()
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = torch.compile(sw.AutoParallel(net), fullgraph=True)
        with pytest.raises(Exception, match="call the wrapper uncompiled"):
            parallel(world.rows(x))
