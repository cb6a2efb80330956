"""`set_auto_parallel_context` / `ParallelMode` and `runtime.set_memory` with `AutoParallel`.

- The older global style (``set_auto_parallel_context(parallel_mode=SEMI_AUTO_PARALLEL,
  dataset_strategy=...)`` then ``AutoParallel(train_step)``) trains seed 003 on 8 simulated
  ranks exactly as the new style (``AutoParallel(train_step, parallel_mode="semi_auto")``):
  same plan, and both match the single-device run (loss and every parameter block, 3 steps).
- Validation: unknown keys and bad values raise ValueError naming the key and valid values; a
  bad call changes nothing; `reset_auto_parallel_context` restores the defaults.
- Unsupported modes raise `UnsupportedParallelError` when the wrapper is created.
- ``device_num`` differing from the world size fails at plan time.
- The context's ``comm_fusion`` is acted on: the same gradient buckets as ``.comm_fusion(...)``.
- `set_memory`: parsing, a cap below the plan's parameter estimate fails before any parameter
  is cut (naming cap, estimate, the three largest tensors), a cap above it passes.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.parallel import AutoParallel, UnsupportedParallelError
from shardwise.testing import SimulatedWorld, assert_matches_single_device, simulated_world

sys.path.insert(0, str(Path(__file__).parent))
from test_seed003_parity import BATCH, LR, WORLD, Network, data
from test_train_step import single_device

from ..planner.test_cost_model import _train_step


@pytest.fixture(autouse=True)
def _clean_context() -> Iterator[None]:
    sw.reset_auto_parallel_context()
    sw.runtime.set_memory(None)
    yield
    sw.reset_auto_parallel_context()
    sw.runtime.set_memory(None)


def train(make: Callable[[Callable[..., torch.Tensor]], AutoParallel], full: bool) -> str:
    """Train seed 003 with the wrapper `make` builds, each rank passing the whole global batch
    (`full`: ``"full_batch"``) or its rows; check it against the single device.

    Returns the plan as text."""
    losses, params = single_device(False)
    batches, net = data(), Network()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=LR)
        loss_fn = torch.nn.CrossEntropyLoss()

        def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = loss_fn(net(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        parallel_net = make(train_step)
        give = world.same if full else world.rows
        for step, (image, label) in enumerate(batches):
            loss = parallel_net(give(image), give(label))
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            plan = parallel_net.parallel_plan
            assert plan is not None
            for name, p in net.named_parameters():
                layout, shape = plan.param_layouts()[name]
                full = params[step][name]
                assert_matches_single_device(
                    p.detach(), lambda r, f=full, s=shape, lay=layout: f[lay.local_slice(r, s)]
                )
        return str(plan)


@pytest.mark.parametrize("strategy", ["data_parallel", "full_batch"])
def test_older_style_trains_like_new_style(strategy: str) -> None:
    def new(step: Callable[..., torch.Tensor]) -> AutoParallel:
        return AutoParallel(step, parallel_mode="semi_auto").dataset_strategy(strategy)

    def old(step: Callable[..., torch.Tensor]) -> AutoParallel:
        sw.set_auto_parallel_context(
            parallel_mode=sw.ParallelMode.SEMI_AUTO_PARALLEL,
            dataset_strategy=strategy,
            device_num=WORLD,
            gradients_mean=True,
        )
        wrapper = AutoParallel(step)
        assert wrapper.parallel_mode == "semi_auto" and wrapper._dataset == strategy
        return wrapper

    new_plan = train(new, strategy == "full_batch")
    sw.reset_auto_parallel_context()
    assert train(old, strategy == "full_batch") == new_plan


def test_wrapper_dataset_strategy_overrides_context() -> None:
    sw.set_auto_parallel_context(dataset_strategy="full_batch")
    assert AutoParallel(Network())._dataset == "full_batch"
    assert AutoParallel(Network()).dataset_strategy("data_parallel")._dataset == "data_parallel"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"parallel_modes": "x"}, "unknown key 'parallel_modes'; valid keys: .*'parallel_mode'"),
        ({"parallel_mode": "semi"}, "parallel_mode='semi' is invalid; valid: .*'auto_parallel'"),
        ({"search_mode": "dp"}, "search_mode='dp' is invalid; valid: .*sharding_propagation"),
        ({"device_num": 0}, r"device_num=0 is invalid; valid: an int in \[1, 4096\]"),
        ({"device_num": True}, "device_num=True is invalid"),
        ({"dataset_strategy": "model"}, "dataset_strategy: 'model'; valid: .*'full_batch'"),
        ({"dataset_strategy": ((2, 1), sw.Layout((8,), ("dp",))("dp"))}, "mixes int tuples"),
        ({"gradients_mean": 1}, "gradients_mean=1 is invalid; valid: True | False"),
        ({"enable_parallel_optimizer": "yes"}, "enable_parallel_optimizer='yes' is invalid"),
        (
            {"parallel_optimizer_config": {"optimizer_level": "level9"}},
            r"parallel_optimizer_config\['optimizer_level'\]='level9' .*level1",
        ),
        (
            {"parallel_optimizer_config": {"threshold": 1}},
            "parallel_optimizer_config=.*unknown: \\['threshold'\\]",
        ),
        (
            {"parallel_optimizer_config": {"optimizer_weight_shard_size": 1}},
            "optimizer_weight_shard_size'\\]=1 is invalid; valid: -1 or an int > 1",
        ),
        ({"comm_fusion": {"allreduce": {"mode": "fast"}}}, "'mode'\\]='fast' .*'size'"),
        ({"comm_fusion": {"openstate": 1}}, "openstate'\\]=1 is invalid"),
        (
            {"comm_fusion": {"allreduce": {"mode": "size", "config": 0}}},
            r"^set_auto_parallel_context: comm_fusion\['allreduce'\]: mode 'size' needs config",
        ),
        (
            {"comm_fusion": {"allreduce": {"mode": "size", "config": "big"}}},
            r"^set_auto_parallel_context: .*needs config = MB > 0 .*got 'big'",
        ),
        (
            {"comm_fusion": {"allreduce": {"mode": "index", "config": 32}}},
            r"^set_auto_parallel_context: .*mode 'index' needs config = a list .*got 32",
        ),
        (
            {"comm_fusion": {"allreduce": {"mode": "index", "config": [-1]}}},
            r"^set_auto_parallel_context: .*indices >= 0 .*got \[-1\]: give the index",
        ),
        ({"strategy_ckpt_config": {"file": "a"}}, "strategy_ckpt_config=.*save_file"),
    ],
)
def test_validation_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sw.set_auto_parallel_context(**kwargs)


def test_set_get_reset() -> None:
    config = {"parallel_optimizer_threshold": 24, "optimizer_level": "level2"}
    sw.set_auto_parallel_context(
        parallel_mode=sw.ParallelMode.AUTO_PARALLEL,
        search_mode="sharding_propagation",
        device_num=8,
        parallel_optimizer_config=config,
        comm_fusion={"openstate": True, "allreduce": {"mode": "size", "config": 32}},
        strategy_ckpt_config={"save_file": "s.ckpt", "only_trainable_params": False},
    )
    assert sw.get_auto_parallel_context("parallel_mode") == "auto_parallel"
    assert sw.get_auto_parallel_context("device_num") == 8
    assert sw.get_auto_parallel_context("parallel_optimizer_config") == config
    with pytest.raises(ValueError, match="device_num"):  # a bad call changes nothing
        sw.set_auto_parallel_context(search_mode="recursive_programming", device_num=-1)
    assert sw.get_auto_parallel_context("search_mode") == "sharding_propagation"
    with pytest.raises(ValueError, match="unknown key 'mode'; valid keys"):
        sw.get_auto_parallel_context("mode")
    sw.reset_auto_parallel_context()
    assert sw.get_auto_parallel_context("parallel_mode") == sw.ParallelMode.STAND_ALONE
    assert sw.get_auto_parallel_context("device_num") is None
    assert sw.get_auto_parallel_context("dataset_strategy") == "data_parallel"
    assert sw.get_auto_parallel_context("parallel_optimizer_config") == {}


@pytest.mark.parametrize(
    ("context", "match"),
    [
        (
            {"parallel_mode": "auto_parallel", "search_mode": "dynamic_programming"},
            "parallel_mode='auto_parallel', search_mode='dynamic_programming'.*not supported",
        ),
    ],
)
def test_unsupported_modes_fail_at_creation(context: dict[str, str], match: str) -> None:
    sw.set_auto_parallel_context(**context)
    with pytest.raises(UnsupportedParallelError, match=match):
        AutoParallel(Network())
    AutoParallel(Network(), parallel_mode="semi_auto")  # an explicit mode wins


def test_an_unknown_explicit_mode_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"valid: 'semi_auto' \| 'sharding_propagation' \|.*, or MindSpore's names "
        r"\(sw.ParallelMode: 'stand_alone' \| 'data_parallel' \| 'semi_auto_parallel' \| "
        r"'auto_parallel'\)",
    ):
        AutoParallel(Network(), parallel_mode="semi_auto_paralel")


@pytest.mark.parametrize(
    ("mode", "search_mode", "resolved"),
    [
        (sw.ParallelMode.SEMI_AUTO_PARALLEL, None, "semi_auto"),
        (sw.ParallelMode.STAND_ALONE, None, "semi_auto"),
        (sw.ParallelMode.DATA_PARALLEL, None, "data_parallel"),
        (sw.ParallelMode.AUTO_PARALLEL, None, "recursive_programming"),
        (sw.ParallelMode.AUTO_PARALLEL, "sharding_propagation", "sharding_propagation"),
    ],
)
def test_an_explicit_mindspore_mode_is_read_as_the_context_reads_it(
    mode: str, search_mode: str | None, resolved: str
) -> None:
    """``parallel_mode=sw.ParallelMode.SEMI_AUTO_PARALLEL`` was refused ("parallel_mode
    'semi_auto_parallel'") although the context takes it."""
    if search_mode is not None:
        sw.set_auto_parallel_context(search_mode=search_mode)
    assert AutoParallel(Network(), parallel_mode=mode).parallel_mode == resolved


def test_an_explicit_auto_parallel_with_an_unsupported_search_mode_is_refused() -> None:
    sw.set_auto_parallel_context(search_mode="dynamic_programming")
    with pytest.raises(
        UnsupportedParallelError,
        match=r"AutoParallel\(parallel_mode='auto_parallel'\) with the context's "
        r"search_mode='dynamic_programming' is not supported",
    ):
        AutoParallel(Network(), parallel_mode=sw.ParallelMode.AUTO_PARALLEL)


def plan_seed003(world: SimulatedWorld, net: Network) -> None:
    AutoParallel(net).plan(world.rank_map(lambda r: torch.zeros(BATCH // WORLD, 1, 28, 28)))


def test_device_num_must_match_world_size() -> None:
    sw.set_auto_parallel_context(device_num=4)
    with simulated_world(WORLD) as world:
        net = Network()
        with pytest.raises(ValueError, match=r"device_num=4\) but the job has 8 ranks"):
            plan_seed003(world, net)
        assert tuple(net.fc1_weight.shape) == (784, 512)
        sw.set_auto_parallel_context(device_num=8)
        x = world.rank_map(lambda r: torch.zeros(4, 1, 28, 28))
        assert net(x).shape == (4, 10)  # the failed wrapper removed its hooks
        net = Network()
        plan_seed003(world, net)
        assert tuple(net.fc1_weight.shape) == (196, 512)


def test_parse_size() -> None:
    parse = sw.runtime.parse_size
    assert parse("512MB") == 512 << 20 and parse("28GB") == 28 << 30
    assert parse("1.5kb") == 1536 and parse(4096) == 4096 and parse("10 B") == 10
    for bad in ("28 gigs", "", "GB", "-1GB", 0, -5, True, 2.5):
        with pytest.raises(ValueError, match="max_size"):
            sw.runtime.set_memory(max_size=bad)  # type: ignore[arg-type]
    sw.runtime.set_memory(max_size="28GB")
    assert sw.runtime.get_memory() == 28 << 30


# Seed 003 on 8 ranks, float32: parameters fc1 (196, 512) + fc2 (64, 512) blocks and fc3
# (512, 10) whole; no optimizer: no optimizer state. The peak is the gradient reduction: the
# parameters and their whole gradients (above the start of backward: the op outputs of a global
# batch of 32, the largest one's gradient and an edge's buffer, 518 KB in all).
PARAMS = (196 * 512 + 64 * 512 + 512 * 10) * 4
ESTIMATE = 2 * PARAMS  # the peak: the gradient reduction (parameters and whole gradients)


def test_set_memory_cap_error_names_largest_tensors() -> None:
    sw.runtime.set_memory(max_size="512KB")
    with simulated_world(WORLD) as world:
        net = Network()
        with pytest.raises(ValueError) as err:
            plan_seed003(world, net)
        assert tuple(net.fc1_weight.shape) == (784, 512)  # nothing was cut
    msg = str(err.value)
    assert (
        f"estimated 1.05 MB ({ESTIMATE} bytes: parameters 540.00 KB, gradients 540.00 KB)"
    ) in msg
    assert "max_size=512.00 KB (524288 bytes)" in msg
    assert (
        "largest: fc1_weight [196, 512] float32 (392.00 KB), fc1_weight.grad [196, 512] float32 "
        "(392.00 KB), fc2_weight [64, 512] float32 (128.00 KB)"
    ) in msg


def test_set_memory_cap_passes() -> None:
    """A cap at the estimate passes; looking for the optimizer (a scan of live objects) touches
    none of them: torch's deprecated ``torch.distributed.reduce_op`` warned on every check."""
    sw.runtime.set_memory(max_size=ESTIMATE)
    with simulated_world(WORLD) as world, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        net = Network()
        plan_seed003(world, net)
        assert tuple(net.fc2_weight.shape) == (64, 512)
    assert not [w for w in seen if "reduce_op" in str(w.message)]


def _buckets(make: Callable[[Network], AutoParallel]) -> list[tuple[str, ...]] | None:
    """The gradient buckets of seed 003 wrapped by `make` after planning."""
    net, (image, _) = Network(), data()[0]
    with simulated_world(WORLD) as world:
        world.replicate(net)
        wrapper = make(net)
        wrapper.plan(world.rank_map(lambda r: image[r * 4 : (r + 1) * 4]))
        plan = wrapper.optimizer_plan
        return None if plan is None else [b.names for b in plan.buckets]


def test_context_comm_fusion_is_acted_on() -> None:
    """The context's ``comm_fusion`` buckets the gradient collectives exactly as the wrapper's
    ``.comm_fusion(...)`` does (without either, gradients go in 25 MB buckets, one per
    replica group, filled in backward order)."""
    fusion = {"allreduce": {"mode": "index", "config": [1]}}
    # fc3 is replicated on all 8 ranks, fc2 on none (its gradient is only scaled), fc1 on g0:
    # three groups, so three buckets, in reverse parameter order
    assert _buckets(AutoParallel) == [("fc3_weight",), ("fc2_weight",), ("fc1_weight",)]
    by_method = _buckets(lambda net: AutoParallel(net).comm_fusion(fusion))
    sw.set_auto_parallel_context(comm_fusion=fusion)
    by_context = _buckets(AutoParallel)
    assert by_method is not None and by_context == by_method


def test_set_memory_cap_holds_for_a_plan_made_again() -> None:
    """A call planned again (another batch size) was not checked: a 16 MB plan ran under a
    1 MB cap. It is refused now, and the plans that fit still run."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    small, big = torch.randn(32, 64), torch.randn(16384, 64)
    sw.runtime.set_memory(max_size="1MB")
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = AutoParallel(_train_step(net))  # (AdamW: two state elements, as Adam)
        parallel(world.rows(small))
        with pytest.raises(ValueError, match=r"AutoParallel: this rank needs an estimated .* MB"):
            parallel(world.rows(big))
        parallel(world.rows(small))  # (the first plan still runs)
