"""Per-input dataset strategies (int tuples and Layout calls) on 8 simulated ranks.

Seed 003's network as a train step: every rank passes its block of each input under the
strategy (the repeat factor appended on the right when the strategy uses fewer than 8 devices),
as the module form does; the loss and every parameter block after each update equal the
single-device run. Also the global
``set_auto_parallel_context(dataset_strategy=...)`` form and every error.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.layout import resolve_strategy
from shardwise.parallel import AutoParallel
from shardwise.testing import SimulatedWorld, assert_matches_single_device, simulated_world

sys.path.insert(0, str(Path(__file__).parent))
from test_seed003_parity import BATCH, WORLD, Network, data, single_device
from test_train_step import single_device as single_device_updates

LAYOUT = sw.Layout((2, 4), ("dp", "mp"))
RANK_LIST = sw.Layout((2, 4), ("dp", "mp"), rank_list=[1, 0, 2, 3, 4, 5, 6, 7])
STRATEGIES: dict[str, Any] = {
    "all8": ((8, 1, 1, 1), (8,)),
    "repeat4": ((2, 1, 1, 1), (2,)),  # 2 blocks of rows, each on 4 consecutive ranks
    "layout": (LAYOUT("dp", "None", "None", "None"), LAYOUT("dp")),
    "layout_tuple": (LAYOUT(("dp", "mp"), "None", "None", "None"), LAYOUT(("dp", "mp"))),
}


def block(world: SimulatedWorld, x: torch.Tensor, index: int, name: str) -> torch.Tensor:
    """Each rank's block of global input `x` under input `index`'s entry of STRATEGIES[name]."""
    layout = resolve_strategy((STRATEGIES[name][index],), WORLD, who="test").layouts[0]
    shape = tuple(x.shape)
    return world.rank_map(lambda r: x[layout.local_slice(r, shape)].clone())


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_train_step_with_per_input_strategy(name: str) -> None:
    losses, params = single_device_updates(False)
    batches, net = data(), Network()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

        def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        parallel = AutoParallel(train_step).dataset_strategy(STRATEGIES[name])
        for step, (image, label) in enumerate(batches):
            loss = parallel(block(world, image, 0, name), block(world, label, 1, name))
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            assert parallel.parallel_plan is not None  # run from the captured plan
            arrive = parallel.parallel_plan.inputs["args[0]"].layout
            assert arrive.split_count(0) == {"all8": 8, "repeat4": 2, "layout": 2}.get(name, 8)
            plan = parallel.parallel_plan
            assert plan is not None
            for pname, p in net.named_parameters():
                layout, shape = plan.param_layouts()[pname]
                full = params[step][pname]
                assert_matches_single_device(
                    p.detach(), lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)]
                )


def test_module_gets_blocks_and_global_context() -> None:
    """A wrapped module under ``((2, 1, 1, 1),)`` from the global context: each rank passes
    rows ``[r // 4 * 16, r // 4 * 16 + 16)``; the logits come back data parallel."""
    losses, _ = single_device(False)
    batches, net = data(), Network()
    half = BATCH // 2
    sw.set_auto_parallel_context(dataset_strategy=((2, 1, 1, 1),))
    try:
        with simulated_world(WORLD) as world:
            world.replicate(net)
            parallel = AutoParallel(net)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            rows = BATCH // WORLD
            for step, (x, y) in enumerate(batches):
                block = world.rank_map(lambda r, x=x: x[r // 4 * half : (r // 4 + 1) * half])
                logits = parallel(block)
                y_rows = world.rank_map(lambda r, y=y: y[r * rows : (r + 1) * rows])
                loss = sw.ops.AllReduce()(F.cross_entropy(logits, y_rows)) / WORLD
                loss.backward()
                assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
                opt.step()
                opt.zero_grad()
    finally:
        sw.reset_auto_parallel_context()


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        ("model_parallel", r"'model_parallel'; valid: 'data_parallel' \| 'full_batch'"),
        (((8, 1, 1, 1),), r"1 entries for 2 tensor inputs"),
        (((8, 1), (8,)), r"input 0: strategy \(8, 1\) has 2 values but the input has 4 dims"),
        (((3, 1, 1, 1), (3,)), r"uses 3 devices .* does not divide the device count 8"),
        (((1, 1, 1, 16), (1,)), r"uses 16 devices"),
        (((8, 1, 1, 1), LAYOUT("dp")), r"mixes int tuples and Layouts"),
        (((8, 1, 0, 1), (8,)), r"^dataset_strategy: strategy entry 0 \(8, 1, 0, 1\) splits dim 2"),
        (  # (a rank_list: named with the Layout's own aliases, not the plan's g0 / g1 matrix)
            (RANK_LIST("dp", "None", "None", "None"), RANK_LIST("dp")),
            r"^dataset_strategy: entry 0 is a call of Layout\(\(2, 4\), \('dp', 'mp'\), "
            r"rank_list=\[1, 0, 2, 3, 4, 5, 6, 7\]\), which orders the devices by its rank_list; "
            r".* Use the Layout without rank_list: sw.Layout\(\(2, 4\), \('dp', 'mp'\)\)$",
        ),
    ],
)
def test_errors(strategy: Any, match: str) -> None:
    image, label = data()[0]
    net = Network()
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(net(inputs), targets)

        with pytest.raises(ValueError, match=match):
            AutoParallel(train_step).dataset_strategy(strategy)(
                world.same(image), world.same(label)
            )
    with pytest.raises(ValueError, match="dataset_strategy"):
        sw.set_auto_parallel_context(dataset_strategy=((8, 1), LAYOUT("dp")))


def test_none_is_a_type_error_naming_the_valid_strategies() -> None:
    """None is no dataset strategy: a TypeError naming the argument and the valid values (not
    a bare AssertionError), from the wrapper and from the global context alike."""
    match = r"^dataset_strategy: None is no dataset strategy; pass 'data_parallel' \(the de"
    with pytest.raises(TypeError, match=match):
        AutoParallel(torch.nn.Linear(4, 4)).dataset_strategy(None)
    with pytest.raises(TypeError, match=match):
        sw.set_auto_parallel_context(dataset_strategy=None)
    sw.reset_auto_parallel_context()


def _squared_error_step(world: SimulatedWorld, net: torch.nn.Module, strategy: Any) -> Any:
    """A wrapped squared-error train step of `net` under per-input `strategy`."""
    world.replicate(net)

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = ((net(inputs) - targets) ** 2).mean()
        loss.backward()
        return loss

    return AutoParallel(train_step).dataset_strategy(strategy)


def test_inputs_passed_as_other_blocks_name_the_strategy_and_the_global_shapes() -> None:
    """Targets passed as quarter-size blocks (equal on the ranks the entry makes replicas)
    under an entry that splits them 2 ways: torch's RuntimeError from inside the capture ("The
    size of tensor a (8) must match the size of tensor b (4)") named neither the strategy nor
    the input; a ValueError names both, with the global shapes worked out from each rank's
    block."""
    x, y, net = torch.randn(8, 16), torch.randn(8, 8), torch.nn.Linear(16, 8)
    with simulated_world(4) as world:
        parallel = _squared_error_step(world, net, ((4, 1), (2, 1)))
        with pytest.raises(ValueError) as caught:
            quarters = world.rank_map(lambda r: y[2 * (r // 2) : 2 * (r // 2) + 2])
            parallel(world.rows(x), quarters)
    message = str(caught.value)
    assert (
        "dataset_strategy(((4, 1), (2, 1))) gives its inputs from this rank's blocks (input 0 "
        "(args[0]): block [2, 16] x splits (4, 1) = global [8, 16]; input 1 (args[1]): block "
        "[2, 8] x splits (2, 1) = global [4, 8]); an input passed as other blocks"
        in message
        and "pass each input as its entry splits it, or change that entry" in message
        and "torch: Attempting to broadcast a dimension of length 4" in message  # (its own)
    ), message


def test_a_fake_kernel_refusal_under_per_input_entries_keeps_its_type_and_names_the_shapes() -> (
    None
):
    """Inputs split on their feature dim where the rows were passed: the linear's fake kernel
    refuses the global shapes (a `FakeKernelError`, a ValueError naming the op and the fix); it
    stays one (it was turned into a plain ValueError) with the entries' global shapes added."""
    from shardwise.planner import FakeKernelError

    x, y, net = torch.randn(8, 16), torch.randn(8, 8), torch.nn.Linear(16, 8)
    with simulated_world(4) as world:
        parallel = _squared_error_step(world, net, ((1, 4), (1, 1)))
        with pytest.raises(FakeKernelError) as caught:
            parallel(world.rows(x), world.same(y))
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "linear" in str(caught.value), caught.value
    assert "block [2, 16] x splits (1, 4) = global [2, 64]" in notes, notes


def test_plan_shapes_of_integer_targets_name_dtypes(caplog: pytest.LogCaptureFixture) -> None:
    """`plan(shapes=...)` of a cross entropy with class targets: the shapes' inputs are float32
    without ``dtypes=``, which the gather in the loss refuses. The FakeKernelError said nothing
    of dtypes and the fake mode logged its traceback first (16 lines); now it names dtypes=
    and nothing is logged. With the dtypes, it plans."""
    from shardwise.planner import FakeKernelError

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.lin(x), y)

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # (torch's: not propagated)
    fake_log.addHandler(caplog.handler)
    with simulated_world(2):
        try:
            with pytest.raises(FakeKernelError) as caught:
                sw.AutoParallel(Net(), parallel_mode="semi_auto").plan(shapes=[(8, 16), (8,)])
        finally:
            fake_log.removeHandler(caplog.handler)
        plan = sw.AutoParallel(Net(), parallel_mode="semi_auto").plan(
            shapes=[(8, 16), (8,)], dtypes=[torch.float32, torch.int64]
        )
    message = str(caught.value)
    assert "cross_entropy" in message and "were float32 (the default without dtypes=)" in message
    assert "dtypes=[torch.float32, torch.int64]" in message
    assert not [r for r in caplog.records if "attempting to run meta" in r.getMessage()]
    assert plan.nodes
