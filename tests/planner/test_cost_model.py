"""The cost model's calibration paths and the training-step estimate.

`load_cost_model` reads a cost file's compute constants (``compute.flops_per_s`` ...) and its
collective fit (``collective.call_s`` ...), keeps the documented default for every field that is
missing or unusable, and reads an older file (point-to-point alpha and beta only) as before;
``call_s`` prices every collective call and redistribution step; `step_cost` estimates a
training step: more than the forward `plan_cost` prices, with the gradient buckets'
AllReduce, and with as many collectives as a simulated run records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.communication.recorder import bytes_bound
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import (
    CostModel,
    capture,
    load_cost_model,
    plan_cost,
    plan_semi_auto,
    step_cost,
)
from shardwise.planner._cost import (
    DEFAULT_CALL_S,
    DEFAULT_FLOPS_PER_S,
    DEFAULT_OP_S,
    DEFAULT_OPTIMIZER_S_PER_ELEMENT,
)
from shardwise.testing import CommRecorder, simulated_world


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_a_cost_file_with_compute_constants_is_read(tmp_path: Path) -> None:
    compute = {
        "flops_per_s": 1.5e11,
        "op_s": 2e-5,
        "traffic_s_per_byte": 1e-10,
        "optimizer_s_per_tensor": 3e-5,
        "optimizer_s_per_element": 4e-9,
    }
    path = _write(
        tmp_path / "c.json", {"alpha_s": 4e-5, "beta_s_per_byte": 2e-10, "compute": compute}
    )
    m = load_cost_model(path)
    assert m.source == str(path)
    assert (m.alpha, m.beta, m.call_s) == ((4e-5,), (2e-10,), DEFAULT_CALL_S)
    for key, value in compute.items():
        assert getattr(m, key) == value, key


def test_missing_or_unusable_fields_keep_their_defaults(tmp_path: Path) -> None:
    old = load_cost_model(
        _write(tmp_path / "old.json", {"alpha_s": 4e-5, "beta_s_per_byte": 2e-10})
    )
    assert old.source != "defaults" and old.alpha == (4e-5,)
    assert old.flops_per_s == DEFAULT_FLOPS_PER_S and old.op_s == DEFAULT_OP_S
    bad = {"flops_per_s": 0, "op_s": -1.0, "optimizer_s_per_element": "fast"}
    m = load_cost_model(
        _write(tmp_path / "bad.json", {"alpha_s": 4e-5, "beta_s_per_byte": 2e-10, "compute": bad})
    )
    assert m.flops_per_s == DEFAULT_FLOPS_PER_S and m.op_s == DEFAULT_OP_S
    assert m.optimizer_s_per_element == DEFAULT_OPTIMIZER_S_PER_ELEMENT
    assert load_cost_model(_write(tmp_path / "list.json", [1, 2])) == CostModel()
    assert load_cost_model(tmp_path / "absent.json") == CostModel()


def test_the_collective_fit_replaces_the_point_to_point_one(tmp_path: Path) -> None:
    base = {"alpha_s": 4e-5, "beta_s_per_byte": 2e-10}
    fit = {"call_s": 1e-4, "alpha_s": 5e-6, "beta_s_per_byte": 5e-10, "form": "x"}
    m = load_cost_model(_write(tmp_path / "f.json", {**base, "collective": fit}))
    assert (m.call_s, m.alpha, m.beta) == (1e-4, (5e-6,), (5e-10,))
    partial = {"alpha_s": 5e-6, "beta_s_per_byte": 5e-10}  # no call_s: not a fit, ignored
    m = load_cost_model(_write(tmp_path / "p.json", {**base, "collective": partial}))
    assert (m.call_s, m.alpha, m.beta) == (DEFAULT_CALL_S, (4e-5,), (2e-10,))


def test_the_defaults_setting_ignores_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    _write(
        tmp_path / "bench" / "results" / "loopback.json",
        {"alpha_s": 4e-5, "beta_s_per_byte": 2e-10, "compute": {"flops_per_s": 1e11}},
    )
    monkeypatch.chdir(tmp_path)
    assert load_cost_model() == CostModel()  # (conftest: SHARDWISE_COST_MODEL=defaults)
    monkeypatch.delenv("SHARDWISE_COST_MODEL")
    assert load_cost_model().flops_per_s == 1e11


def test_call_s_prices_every_collective_and_redistribution_step() -> None:
    plain, called = CostModel(), CostModel(call_s=1e-4)
    for kind in ("AllReduce", "AllGather", "AlltoAll", "ReduceScatter"):
        extra = called.collective(kind, 4096, 4, 0) - plain.collective(kind, 4096, 4, 0)
        assert math.isclose(extra, 1e-4), kind
    assert called.collective("AllReduce", 4096, 1, 0) == 0.0  # no group, no call
    m = DeviceMatrix((2, 4), ("dp", "mp"))
    split, whole = TensorLayout(m, ((0,), (1,))), TensorLayout(m, ((), ()))
    steps = called.move(split, whole, (8, 8), 4) - plain.move(split, whole, (8, 8), 4)
    assert math.isclose(steps, 2e-4)  # two AllGathers (one per axis)


def test_a_reduction_followed_by_a_cut_is_priced_as_the_reduce_scatter_that_runs() -> None:
    """A partial sum over mp that its consumer takes cut to rows over mp runs as one
    ReduceScatter (`planner/_scatter.py`): the planners price it so, not as an AllReduce of the
    whole block; an edge the plan keeps whole (``scatter=False``) pays the AllReduce."""
    model = CostModel((1e-5,), (1e-10,))
    m = DeviceMatrix((2, 4), ("dp", "mp"))
    whole, rows = TensorLayout(m, ((), ())), TensorLayout(m, ((1,), ()))
    # an 8 KiB block on 4 ranks: 3 rounds and 3/4 of it sent; the AllReduce 6 rounds and 3/2
    assert math.isclose(model.move(whole, rows, (64, 32), 4, reduced=(1,)), 3e-5 + 6144e-10)
    kept = model.move(whole, rows, (64, 32), 4, reduced=(1,), scatter=False)
    assert math.isclose(kept, 6e-5 + 12288e-10)
    # partial over both axes: the ReduceScatter over mp, then an AllReduce over dp of the 2 KiB
    # part (2 rounds, 2 KiB sent)
    both = model.move(whole, rows, (64, 32), 4, reduced=(0, 1))
    assert math.isclose(both, 3e-5 + 6144e-10 + 2e-5 + 2048e-10)
    # a cut over an axis that is not reduced: the AllReduce, then a free Slice
    dp_rows = TensorLayout(m, ((0,), ()))
    assert math.isclose(model.move(whole, dp_rows, (64, 32), 4, reduced=(1,)), kept)


def _mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))


def _train_step(net: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def test_the_step_estimate_exceeds_the_forward_and_counts_gradient_sync() -> None:
    net = _mlp(32)
    graph = capture(_train_step(net), torch.zeros(64, 32), networks=[net])
    plan = plan_semi_auto(graph, 4)  # data parallel: every gradient all-reduced over 4
    model = CostModel()
    step, forward = step_cost(plan, model), plan_cost(plan, model)
    assert step.total > forward.total
    assert step.compute > forward.compute  # backward's FLOPs and every op's overhead
    params = sum(p.numel() * 4 for p in net.parameters())
    assert math.isclose(step.grad_sync, model.all_reduce(params, plan.matrix, [0]))
    assert step.backward_comm == 0.0  # data parallel: nothing but the gradients
    assert step.optimizer == pytest.approx(
        4 * model.optimizer_s_per_tensor + params / 4 * model.optimizer_s_per_element
    )
    slower = step_cost(plan, CostModel(beta=(1e-8,))).grad_sync - step.grad_sync
    assert math.isclose(slower, bytes_bound("AllReduce", params, 4) * (1e-8 - 1e-10))
    assert step.collectives == 2  # the gradients' bucket and the loss
    # one device: no collective at all
    alone = step_cost(plan_semi_auto(graph, 1), model)
    assert alone.comm == 0.0 and alone.collectives == 0


@pytest.mark.parametrize("how", ["data parallel", "megatron", "optimizer parallel"])
def test_the_step_estimate_counts_the_collectives_a_run_records(how: str) -> None:
    """Forward edges and ops' collectives, their adjoints, the gradient buckets (optimizer
    parallel: a ReduceScatter and an AllGather) and the loss, as a 4-rank simulated run of the
    train step records them."""
    hidden = 32
    net = _mlp(hidden)
    if how == "megatron":
        sw.shard(net[0], in_strategy=((1, 1), (4, 1)))
        sw.shard(net[2], in_strategy=((1, 4), (1, 4)))
    if how == "optimizer parallel":
        config = {"parallel_optimizer_threshold": 0}
        sw.set_auto_parallel_context(
            enable_parallel_optimizer=True, parallel_optimizer_config=config
        )
    x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(1))
    try:
        with simulated_world(4) as world:
            world.replicate(net)
            parallel = sw.AutoParallel(_train_step(net), parallel_mode="semi_auto")
            parallel(world.rows(x))
            with CommRecorder() as rec:
                parallel(world.rows(x))
    finally:
        sw.reset_auto_parallel_context()
    plan = parallel.parallel_plan
    assert plan is not None
    step = step_cost(plan, CostModel())
    assert step.collectives == len(rec.records)
    # Megatron's AllReduce (the row-parallel output made whole for ``square``) has a local
    # adjoint in ``loss.backward()``: only ops alike on every rank read it (`EdgePlan.seeded`)
    seeded = [e for e in plan.edges if e.seeded and e.consumer >= 0]
    assert len(seeded) == (1 if how == "megatron" else 0)
    assert step.backward_comm == 0.0
    assert (rec.count(phase="step") == 1) == (how == "optimizer parallel")


def test_a_seeded_edge_still_counts_its_gathers_adjoint() -> None:
    """2 x 2 Megatron MLP whose row-parallel output (partial over mp, rows split over dp) feeds
    ``softmax(0)`` over the rows: the edge all-reduces over mp and gathers the rows over dp.
    Only tail ops read it (`EdgePlan.seeded`): in ``loss.backward()`` its AllReduce's adjoint
    is local, its AllGather's (a ReduceScatter over dp) still runs; the estimate counts what a
    run records."""
    net = _mlp(8)
    sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
    sw.shard(net[2], in_strategy=((2, 2), (1, 2)))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))

    def step(a: torch.Tensor) -> torch.Tensor:
        loss = net(a).softmax(0).square().mean()
        loss.backward()
        return loss

    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        parallel(world.rows(x))
        with CommRecorder() as rec:
            parallel(world.rows(x))
    plan = parallel.parallel_plan
    assert plan is not None
    seeded = [e for e in plan.edges if e.seeded and e.consumer >= 0]
    assert len(seeded) == 1 and seeded[0].steps, [str(e) for e in plan.edges]
    step_estimate = step_cost(plan, CostModel())
    assert rec.count(kind="ReduceScatter", phase="backward") == 1, rec.summary()
    assert step_estimate.collectives == len(rec.records) and step_estimate.backward_comm > 0.0
