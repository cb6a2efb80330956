"""What a `ParallelPlan` records beyond the ops, and strategy files that set it.

- The gradient / optimizer-parallel buckets are part of the plan (`ParallelPlan.buckets`):
  printed, saved and loaded with it, and the run issues exactly one collective per bucket.
- A parameter strategy file is a directive (MindSpore's ``strategy_ckpt_load_file``): an
  unannotated network that loads one stores its parameters as the file says and still trains
  like one device; a file for another network or device count is refused before anything runs.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.planner import BucketPlan, ParallelPlan, StrategyFileError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..planner.test_plan import step_of
from ..zoo import GPT2, token_batches

WORLD, LR = 4, 0.1


def _mlp() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


class Sharded(nn.Module):
    """The MLP with its weights stored as 4 row blocks (a parameter plan)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = sw.shard(_mlp(), None, parameter_plan={"0.weight": (4, 1), "2.weight": (4, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(x)
        return out


class Plain(nn.Module):
    """The same MLP and parameter names, without annotations."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(x)
        return out


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 8, (8,), generator=g)) for _ in "ab"]


def _single_device() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    net = Plain()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def _train(net: nn.Module, load: Path | None = None) -> AutoParallel:
    """Two SGD steps of `net` on 4 simulated ranks (each passing its rows), checked against one
    device: losses and every parameter block as the plan stores it."""
    want_losses, want_params = _single_device()
    batches = _batches()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = AutoParallel(step)
        if load is not None:
            parallel.load_param_strategy_file(load)
        for (x, y), want in zip(batches, want_losses, strict=True):
            assert_matches_single_device(parallel(world.rows(x), world.rows(y)), want)
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in net.named_parameters():
            layout, shape = plan.param_layouts()[name]
            full = want_params[name]
            assert_matches_single_device(
                p.detach(), lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)], what=name
            )
    return parallel


def test_a_parameter_strategy_file_sets_the_storage(tmp_path: Path) -> None:
    first = _train(Sharded())
    first.save_param_strategy_file(tmp_path / "params.json")
    net = Plain()
    again = _train(net, load=tmp_path / "params.json")
    assert tuple(net.mlp[0].weight.shape) == (16, 32)  # stored as the file says: 1/4 of the rows
    assert tuple(net.mlp[2].weight.shape) == (2, 64)
    plan, saved = again.parallel_plan, first.parallel_plan
    assert plan is not None and saved is not None
    assert plan.params == saved.params


def test_a_parameter_file_of_another_job_is_refused(tmp_path: Path) -> None:
    _train(Sharded()).save_param_strategy_file(tmp_path / "params.json")
    x, net, other = torch.randn(8, 32), Plain(), nn.Sequential(nn.Linear(32, 8))
    with simulated_world(2) as world:  # another device count
        world.replicate(net)
        parallel = AutoParallel(net).load_param_strategy_file(tmp_path / "params.json")
        with pytest.raises(StrategyFileError, match=r"planned for 4 devices, the job has 2"):
            parallel(world.rows(x))
        assert net(world.rows(x)).shape == (4, 8)  # the network is given back, uncut
    with simulated_world(WORLD) as world:  # another network
        world.replicate(other)
        parallel = AutoParallel(other).load_param_strategy_file(tmp_path / "params.json")
        with pytest.raises(StrategyFileError, match=r"no layout for parameter '0.weight'"):
            parallel(world.rows(x))


def test_the_plan_holds_the_gradient_buckets(tmp_path: Path) -> None:
    """GPT-2 with no annotation on 2 ranks: every gradient in one 25 MB bucket over g0, in the
    plan (printed, saved) and in the run (one backward AllReduce)."""
    (x, y), *_ = token_batches(1, 8)
    net = GPT2()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = AutoParallel(step_of(net, torch.optim.SGD(net.parameters(), lr=LR)))
        with CommRecorder() as rec:
            parallel(world.rows(x), world.rows(y))
    plan = parallel.parallel_plan
    assert plan is not None
    (bucket,) = plan.buckets
    assert (bucket.kind, bucket.axes, bucket.shard) == ("allreduce", ("g0",), 1)
    assert set(bucket.params) == {n for n, _ in net.named_parameters()}
    assert bucket.params[0] == "lm_head.weight" or bucket.params[-1] == "transformer.wte.weight"
    assert "  bucket AllReduce over g0 fusion=-1: " in str(plan)
    backward = Counter(r.kind for r in rec.select(phase="backward"))
    assert backward == Counter({"AllReduce": len(plan.buckets)}), rec.summary()
    plan.save(tmp_path / "plan.json")
    assert ParallelPlan.load(tmp_path / "plan.json").buckets == plan.buckets


def test_hsdp_buckets_are_in_the_plan() -> None:
    """With optimizer parallel (threshold 0) every parameter is sharded 4 ways over the
    data-parallel axis, in one bucket of fusion id 1 (the default id); `plan(shapes=...)`
    plans from the global input shape."""
    net = Plain()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net).hsdp(threshold=0)
        plan = parallel.plan(shapes=[(8, 32)])
    assert plan.buckets == (
        BucketPlan(
            "shard",
            ("g0",),
            ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"),
            4,
            1,
            "level1",
        ),
    )
    assert tuple(net.mlp[0].weight.shape) == (16, 32)  # this rank's shard at rest


def test_a_network_holding_blocks_refuses_calls_outside_its_wrapper() -> None:
    """Once a plan stores parameters as blocks, calling the network itself (not the wrapper)
    raises, naming the fix; a plan that keeps every parameter whole lets it run (evaluation on
    this rank's rows)."""
    sharded, plain, x = Sharded(), Plain(), torch.randn(8, 32)
    with simulated_world(WORLD) as world:
        world.replicate(sharded)
        world.replicate(plain)
        AutoParallel(sharded).plan(world.rows(x))
        with pytest.raises(RuntimeError, match=r"called outside its wrapper; .* blocks"):
            sharded(world.rows(x))
        AutoParallel(plain).plan(world.rows(x))
        assert plain(world.rows(x)).shape == (2, 8)


def test_strategy_ckpt_config_saves_and_loads_the_parameter_file(tmp_path: Path) -> None:
    """MindSpore's context way: ``save_file`` writes the parameter strategy file when the
    wrapper plans (the same file `save_param_strategy_file` writes), ``load_file`` makes a new
    wrapper store its parameters as the file says."""
    path = tmp_path / "ckpt" / "strategy.json"
    try:
        sw.set_auto_parallel_context(strategy_ckpt_config={"save_file": str(path)})
        first = _train(Sharded())
        first.save_param_strategy_file(tmp_path / "explicit.json")
        assert path.read_text() == (tmp_path / "explicit.json").read_text()
        sw.set_auto_parallel_context(strategy_ckpt_config={"load_file": str(path)})
        net = Plain()
        _train(net)
        assert tuple(net.mlp[0].weight.shape) == (16, 32)  # stored as the file says
    finally:
        sw.reset_auto_parallel_context()


def test_only_trainable_params(tmp_path: Path) -> None:
    """``only_trainable_params`` (MindSpore's default True) leaves frozen parameters out of the
    saved file; a network loading that file plans them as usual. A missing ``load_file`` is
    refused when the wrapper is made."""
    path = tmp_path / "strategy.json"
    x = torch.randn(8, 32)
    try:
        for only in (True, False):
            sw.set_auto_parallel_context(
                strategy_ckpt_config={"save_file": str(path), "only_trainable_params": only}
            )
            net = Sharded()
            net.mlp[0].bias.requires_grad_(False)
            with simulated_world(WORLD) as world:
                world.replicate(net)
                AutoParallel(net)(world.rows(x))
            saved = json.loads(path.read_text())["params"]
            assert ("mlp.0.bias" in saved) is not only and "mlp.0.weight" in saved
        sw.set_auto_parallel_context(strategy_ckpt_config={"load_file": str(path)})
        plain = Plain()
        plain.mlp[0].bias.requires_grad_(False)
        with simulated_world(WORLD) as world:
            world.replicate(plain)
            assert AutoParallel(plain)(world.rows(x)).shape == (2, 8)
        assert tuple(plain.mlp[0].weight.shape) == (16, 32)
        sw.set_auto_parallel_context(strategy_ckpt_config={"load_file": str(tmp_path / "none")})
        with pytest.raises(StrategyFileError, match=r"none: cannot read the parameter strategy"):
            AutoParallel(Plain())
    finally:
        sw.reset_auto_parallel_context()


def _load_into(net: nn.Module, path: Path, *inputs: torch.Tensor) -> str:
    """The `StrategyFileError` message of `net` (2 ranks) loading the operator strategy file
    `path` and called on `inputs`."""
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = AutoParallel(net).load_operator_strategy_file(path)
        with pytest.raises(StrategyFileError) as info:
            parallel(*(world.rows(t) for t in inputs))
    return str(info.value)


def test_a_file_of_another_vocabulary_names_the_embedding_weight(tmp_path: Path) -> None:
    """nanoGPT saved with a 64-token vocabulary, loaded by one of 80: the message names the
    first real difference, the (tied) embedding weight and both shapes, not the head's op."""
    (x, y), *_ = token_batches(1, 8)
    saved = GPT2(vocab_size=64)
    with simulated_world(2) as world:
        world.replicate(saved)
        first = AutoParallel(saved)
        first(world.rows(x), world.rows(y))
        first.save_operator_strategy_file(tmp_path / "ops.json")
    message = _load_into(GPT2(vocab_size=80), tmp_path / "ops.json", x, y)
    assert message == (
        f"{tmp_path / 'ops.json'}: parameter 'transformer.wte.weight' has shape [64, 32] in "
        f"the file, [80, 32] in this network"
    )


class MeanOverTime(nn.Module):
    """A mean over dim 1 first: another sequence length changes its input, not its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x.mean(1))
        return out


def test_an_op_whose_input_differs_is_named_at_that_op(tmp_path: Path) -> None:
    """Saved for 16 steps, called with 12: the mean's output shapes agree, its input does not;
    the message names that op, the input and both shapes (nothing else differs)."""
    net, x, shorter = MeanOverTime(), torch.randn(8, 16, 4), torch.randn(8, 12, 4)
    with simulated_world(2) as world:
        world.replicate(net)
        first = AutoParallel(net)
        first(world.rows(x))
        first.save_operator_strategy_file(tmp_path / "ops.json")
    message = _load_into(MeanOverTime(), tmp_path / "ops.json", shorter)
    assert message.startswith(f"{tmp_path / 'ops.json'}: op %0 ")
    assert "(input:args[0]) of shape [8, 16, 4] in the file, [8, 12, 4] in this network" in message


def _saved_plan(path: Path, level: str | None = None, dtype: torch.dtype = torch.float32) -> None:
    """`Plain`'s operator strategy file on `WORLD` ranks (hsdp at `level`, or none)."""
    net = Plain().to(dtype)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        if level is not None:
            parallel.hsdp(threshold=0, optimizer_level=level)
        parallel.plan(shapes=[(8, 32)], dtypes=[dtype])
        parallel.save_operator_strategy_file(path)


@pytest.mark.parametrize(
    ("saved", "loading", "match"),
    [
        (("level1", torch.float32), ("level3", torch.float32), r"bucket 0: shard 4-way level1 "),
        ((None, torch.float32), (None, torch.bfloat16), r"is float32 in the file but bfloat16"),
    ],
    ids=["hsdp-level", "dtype"],
)
def test_a_file_of_other_settings_names_them(
    tmp_path: Path, saved: tuple[Any, torch.dtype], loading: tuple[Any, torch.dtype], match: str
) -> None:
    """A level-1 file in a level-3 job (which gathers the weights again in backward) was
    taken as equal; a float32 file in a bfloat16 network was said to store a parameter in a
    layout it could not have."""
    _saved_plan(tmp_path / "ops.json", *saved)
    level, dtype = loading
    net, x = Plain().to(dtype), torch.randn(8, 32, dtype=dtype)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net).load_operator_strategy_file(tmp_path / "ops.json")
        if level is not None:
            parallel.hsdp(threshold=0, optimizer_level=level)
        with pytest.raises(StrategyFileError, match=match):
            parallel(world.rows(x))


def test_diff_names_every_difference() -> None:
    """Plans that differ only in their mode, or in one bucket, say so."""
    plans = {}
    for mode, level in (("semi_auto", None), ("sharding_propagation", None), ("semi_auto", "x")):
        net = Plain()
        with simulated_world(WORLD) as world:
            world.replicate(net)
            parallel = AutoParallel(net, parallel_mode=mode)
            if level:
                parallel.hsdp(threshold=0)
            plans[mode, level] = parallel.plan(shapes=[(8, 32)])
    base = plans["semi_auto", None]
    assert base.diff(plans["sharding_propagation", None]) == [
        "mode: semi_auto -> sharding_propagation"
    ]
    (line,) = base.diff(plans["semi_auto", "x"])
    assert line.startswith("bucket 0: AllReduce over g0 fusion=-1: ") and "shard 4-way" in line


def test_data_parallel_mode_has_no_strategy_file_to_save(tmp_path: Path) -> None:
    """After a data_parallel call the error said no plan was made yet (call the wrapper)."""
    net, x = Plain(), torch.randn(8, 32)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = AutoParallel(net, parallel_mode="data_parallel")
        parallel(world.rows(x))
        for save in (parallel.save_operator_strategy_file, parallel.save_param_strategy_file):
            with pytest.raises(ValueError, match="'data_parallel' makes no operator plan"):
                save(tmp_path / "x.json")


def _frozen_job(freeze_first: bool, load: Path | None = None, save: Path | None = None) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    net[0].weight.requires_grad_(not freeze_first)
    with simulated_world(2) as w:
        w.replicate(net)
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(net(a), b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        ap = AutoParallel(step, parallel_mode="semi_auto")
        if load is not None:
            ap.load_operator_strategy_file(load)
        ap(w.rows(x), w.rows(y))
        if save is not None:
            ap.save_operator_strategy_file(save)


def test_a_strategy_file_of_other_frozen_parameters_names_the_parameter(tmp_path: Path) -> None:
    """A plan file saved with ``0.weight`` frozen, loaded where it requires grad (or the
    reverse), names the parameter and the requires_grad fix (it blamed the gradient buckets
    and hsdp() / comm_fusion() settings)."""
    _frozen_job(True, save=tmp_path / "frozen.json")
    _frozen_job(False, save=tmp_path / "trainable.json")
    with pytest.raises(StrategyFileError) as refused:
        _frozen_job(False, load=tmp_path / "frozen.json")
    message = str(refused.value)
    assert "'0.weight' requires grad in this network but was frozen" in message
    assert "set the same requires_grad as the saving job" in message
    assert "comm_fusion" not in message
    with pytest.raises(StrategyFileError, match=r"'0.weight' is frozen .* same requires_grad"):
        _frozen_job(True, load=tmp_path / "trainable.json")
