"""A second network in the train step: a knowledge-distillation teacher.

- A frozen teacher outside the wrapped network (``network=student``, ``with torch.no_grad():
  t = teacher(x)``) runs by the plan, its weights constants held whole on every rank: the losses,
  the student's gradients and its weights equal one device's. In a simulated world its
  per-rank weights were captured as per-rank tensors, so its ops were planned unsplit yet ran on
  each rank's rows: a batch mean of its output was each rank's own (a silently wrong loss,
  different per rank), ``F.mse_loss(out, t)`` torch's size mismatch.
- A teacher wrapped in its own AutoParallel and called inside the student's planned wrapped step
  is refused with a ValueError naming both wrappers and the fix (one container as
  ``network=``); it failed inside the capture, at torch's DeviceMesh reading a fake tensor.
  Inside a data_parallel-mode step (run as written) it runs as alone.
- An EMA teacher inside the network (frozen, updated from the student after ``opt.step()``)
  under hsdp meets the student's shards (only parameters that require grad are sharded):
  torch's size mismatch now carries a note naming both parameters and the fix; with that fix
  (the teacher's parameters require grad, in no optimizer) it trains as one device.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


def nets(megatron: bool = False) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    teacher = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).requires_grad_(False)
    if megatron:
        sw.shard(student[0], in_strategy=((1, 1), (2, 1)))  # column parallel
        sw.shard(student[2], in_strategy=((1, 2), (1, 2)))  # row parallel
    return student, teacher


def kd_step(
    student: nn.Module, teacher: nn.Module, loss_kind: str, grads: list[dict[str, Any]]
) -> Any:
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = teacher(x)
        out = student(x)
        if loss_kind == "mean":  # (a batch mean of the teacher's output)
            loss = F.cross_entropy(out, y) + ((out.mean(0) - t.mean(0)) ** 2).sum()
        else:
            loss = F.cross_entropy(out, y) + F.mse_loss(out, t)
        opt.zero_grad()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in student.named_parameters()})
        opt.step()
        return loss

    return step


@pytest.mark.parametrize(
    ("mode", "megatron", "loss_kind"),
    [
        ("semi_auto", False, "mean"),
        ("semi_auto", False, "mse"),
        ("sharding_propagation", True, "mean"),
    ],
)
def test_a_frozen_teacher_outside_the_network_trains_as_one_device(
    mode: str, megatron: bool, loss_kind: str
) -> None:
    student, teacher = nets()
    want_grads: list[dict[str, Any]] = []
    one = kd_step(student, teacher, loss_kind, want_grads)
    want = [one(x, y).detach() for x, y in DATA]
    student2, teacher2 = nets(megatron)
    seen: list[dict[str, Any]] = []
    with simulated_world(2) as world:
        world.replicate(student2)
        world.replicate(teacher2)
        step = kd_step(student2, teacher2, loss_kind, seen)
        run = sw.AutoParallel(step, parallel_mode=mode, network=student2)
        got = [run(world.rows(x), world.rows(y)) for x, y in DATA]
        plan = run.parallel_plan
        assert plan is not None

        def block(name: str, full: torch.Tensor) -> Any:
            lay = plan.params[name].layout
            return lambda r: full[lay.local_index(r, tuple(full.shape))]

        for i, loss in enumerate(got):
            assert_matches_single_device(loss, want[i], what=f"loss {i}")
            for name, full in want_grads[i].items():
                assert_matches_single_device(seen[i][name], block(name, full), what=name)
        for name, p in student.named_parameters():
            got_p = student2.get_parameter(name).detach()
            assert_matches_single_device(got_p, block(name, p.detach()), what=name)


@pytest.mark.parametrize("inner_mode", ["data_parallel", "semi_auto"])
def test_a_wrapped_teacher_inside_a_data_parallel_step_runs_as_alone(inner_mode: str) -> None:
    """parallel_mode="data_parallel" runs its step as written: a teacher wrapped on its own
    runs inside it as it would alone (the guard against nested wrappers refused it)."""
    student, teacher = nets()
    one = kd_step(student, teacher, "mse", [])
    want = [one(x, y).detach() for x, y in DATA]
    student2, teacher2 = nets()
    with simulated_world(2) as world:
        world.replicate(student2)
        world.replicate(teacher2)
        inner = sw.AutoParallel(teacher2, parallel_mode=inner_mode)
        step = kd_step(student2, inner, "mse", [])
        run = sw.AutoParallel(step, parallel_mode="data_parallel", network=student2)
        for i, (x, y) in enumerate(DATA):
            assert_matches_single_device(run(world.rows(x), world.rows(y)), want[i], what=f"{i}")


def test_a_wrapper_called_inside_another_wrappers_step_is_refused() -> None:
    student, teacher = nets()
    x, y = DATA[0]
    with simulated_world(2) as world:
        world.replicate(student)
        world.replicate(teacher)
        inner = sw.AutoParallel(teacher, parallel_mode="semi_auto")
        step = kd_step(student, inner, "mse", [])
        run = sw.AutoParallel(step, parallel_mode="semi_auto", network=student)
        with pytest.raises(ValueError, match=r"called inside the call of .*container module"):
            run(world.rows(x), world.rows(y))


class Both(nn.Module):
    """A student and its EMA teacher (a frozen copy) in one network."""

    def __init__(self, teacher_trains: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(teacher_trains)


def ema_step(net: Both) -> Any:
    opt = torch.optim.SGD(net.student.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = net.teacher(x + 0.1)
        out = net.student(x)
        loss = F.cross_entropy(out, y) + F.mse_loss(out, t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for tp, sp in zip(net.teacher.parameters(), net.student.parameters(), strict=True):
                tp.mul_(0.9).add_(sp, alpha=0.1)
        return loss

    return step


def test_a_frozen_ema_teacher_under_hsdp_is_named_with_the_fix() -> None:
    net = Both()
    x, y = DATA[0]
    with simulated_world(2) as world:
        world.replicate(net)
        run = sw.AutoParallel(ema_step(net), parallel_mode="semi_auto", network=net)
        run.hsdp(threshold=0)
        with pytest.raises(RuntimeError, match="must match") as caught:
            run(world.rows(x), world.rows(y))
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "teacher.0.weight needs no gradient" in note, note
    assert "student.0.weight, of the same global shape, as [8, 8]" in note, note
    assert "require grad, in no optimizer" in note and "without hsdp" in note, note


@pytest.mark.parametrize("level", ["level1", "level3"])
def test_an_ema_teacher_that_requires_grad_trains_under_hsdp_as_one_device(level: str) -> None:
    ref = Both(teacher_trains=True)
    one = ema_step(ref)
    want = [one(x, y).detach() for x, y in DATA]
    net = Both(teacher_trains=True)
    with simulated_world(2) as world:
        world.replicate(net)
        run = sw.AutoParallel(ema_step(net), parallel_mode="semi_auto", network=net)
        run.hsdp(threshold=0, optimizer_level=level)
        for i, (x, y) in enumerate(DATA):
            assert_matches_single_device(run(world.rows(x), world.rows(y)), want[i], what=f"{i}")
        for name, p in ref.teacher.named_parameters():  # (each rank's shard: its rows)
            full = p.detach()
            rows = full.shape[0] // 2
            got = net.teacher.get_parameter(name).detach()
            assert_matches_single_device(got, lambda r, f=full, k=rows: f[r * k : (r + 1) * k])


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_teachers_batch_norm_in_training_mode_counts_as_one_device(
    momentum: float | None,
) -> None:
    """A teacher outside the network with a BatchNorm left in training mode: the capture ran
    its forward on its real buffers (one batch too many in ``num_batches_tracked``), and with
    ``momentum=None`` the capture refused its ``float(num_batches_tracked)``."""

    def teacher() -> nn.Sequential:
        torch.manual_seed(0)
        bn = nn.BatchNorm1d(32, momentum=momentum)
        return nn.Sequential(nn.Linear(8, 32), bn, nn.Tanh(), nn.Linear(32, 4)).requires_grad_(
            False
        )

    student, _ = nets()
    ref = teacher()
    one = kd_step(student, ref, "mse", [])
    want = [one(x, y).detach() for x, y in DATA]
    student2, _ = nets()
    t2 = teacher()
    with simulated_world(2) as world:
        world.replicate(student2)
        world.replicate(t2)
        run = sw.AutoParallel(kd_step(student2, t2, "mse", []), network=student2)
        for i, (x, y) in enumerate(DATA):
            assert_matches_single_device(run(world.rows(x), world.rows(y)), want[i], what=f"{i}")
        for name, b in ref.named_buffers():
            assert_matches_single_device(t2.get_buffer(name), b, what=name)
