"""Levels 1-2 keep each sharded parameter's compute leaf past the optimizer step and gather the
next step's weights into it in place (the same tensor, its hooks, its storage; no new buffer
per step); level 3 still makes new ones. A bucket whose member had no leaf in the last step
(unused then) gets new leaves for all its members. A leaf reused after a ``requires_grad_``
of its parameter (made by an evaluation since the step, or by the step's earlier forward) is
frozen or unfrozen with it. 2 and 4 simulated ranks, results equal
single-device training. (A graph kept across a refill is refused by autograd: checked on real
processes, `tests/multiprocess/hsdp_pairwise_worker.py`.)"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

sys.path.insert(0, str(Path(__file__).parent))
from test_hsdp import SMALL, Mlp, shard_of, single_device, train


def train_and_compare(
    world_size: int,
    net: nn.Module,
    opt: str,
    level: str,
    check: Callable[[int, AutoParallel, CommRecorder], None],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    want_losses: list[float],
    want_params: dict[str, torch.Tensor],
) -> None:
    """Train `net` with hsdp `level` (`check` after each step): every loss and every rank's
    shard of the final weights equal single-device training's."""
    with simulated_world(world_size) as world:
        parallel, _, losses = train(
            world, net, opt, lambda p: p.hsdp(threshold=0, optimizer_level=level), check, batches
        )
        for step, loss in enumerate(losses):
            assert_matches_single_device(loss, torch.tensor(want_losses[step]), what=f"loss {step}")
        for name, p in net.named_parameters():
            rows = shard_of(parallel, name, want_params[name])
            assert_matches_single_device(p.detach(), rows, what=name)


def engine_leaf(parallel: AutoParallel, name: str) -> torch.Tensor:
    engine = parallel._engine
    assert engine is not None
    return engine.leaves[name]


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_levels_1_2_refill_the_same_leaf_in_place(level: str) -> None:
    """Every step after the first gathers layer2's weight into last step's leaf (levels 1-2:
    same object, version bumped, storage reused); level 3 makes a new leaf each step. The
    losses and updated weights equal single-device training either way."""
    want_losses, want_params = single_device(lambda: Mlp(small=True), "adamw", SMALL)
    seen: list[tuple[torch.Tensor, int]] = []  # (the leaf, its version) after each step

    def check(step: int, parallel: AutoParallel, rec: CommRecorder) -> None:
        engine = parallel._engine
        assert engine is not None
        for name in ("layer1.weight", "layer2.weight"):  # a one-member bucket (id 0), a shared one
            leaf = engine.leaves.get(name)  # (level 3: dropped at the step)
            if leaf is not None:
                seen.append((leaf, leaf._version))

    net, final = Mlp(small=True), want_params[-1]
    train_and_compare(2, net, "adamw", level, check, SMALL, want_losses, final)
    if level == "level3":
        assert not seen  # no leaf kept past a step
        return
    assert len(seen) == 2 * len(SMALL)
    for per_name in (seen[0::2], seen[1::2]):
        assert all(leaf is per_name[0][0] for leaf, _ in per_name)  # one leaf
        versions = [v for _, v in per_name]
        assert versions == sorted(versions) and len(set(versions)) == len(versions)  # refilled


class Sometimes(nn.Module):
    """Two layers in one fusion bucket (id 1); `extra` runs only when `use_extra` is set. Its first
    activation is a shardwise primitive, so the primitive runtime runs it, deciding the torch ops
    around it one by one (a network of plain torch ops runs one captured plan and must run the
    same ops every step)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.flatten, self.first = nn.Flatten(), nn.Linear(64, 32)
        self.extra, self.head = nn.Linear(32, 32), nn.Linear(32, 16)
        self.act = sw.ops.ReLU()
        sw.set_comm_fusion(self.first, 1)
        sw.set_comm_fusion(self.extra, 1)
        sw.set_comm_fusion(self.head, 2)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.first(self.flatten(x)))
        if self.use_extra:
            h = torch.relu(self.extra(h))
        out: torch.Tensor = self.head(h)
        return out


@pytest.mark.parametrize("level", ["level1", "level2"])
def test_members_used_in_some_steps_only_and_a_bucket_missing_a_leaf(level: str) -> None:
    """`extra` is skipped in step 0 and used from step 1 on: its leaf, gathered ahead with its
    bucket, gets no gradient in step 0 (no update, as on one device) and is refilled in place
    like the others. Then, with one member's leaf taken away after step 1 (a bucket half without
    leaves), step 2 gathers the bucket into new leaves for all its members, and step 3 refills
    those. Losses and weights equal single-device training with the same schedule."""
    use = [False, True, True, True]
    batches = SMALL[: len(use)]

    def single() -> tuple[list[float], dict[str, torch.Tensor]]:
        net, losses = Sometimes(), []
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for flag, (x, y) in zip(use, batches, strict=True):
            net.use_extra = flag
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {n: p.detach().clone() for n, p in net.named_parameters()}

    want_losses, want_params = single()
    net = Sometimes()
    leaves: list[torch.Tensor] = []

    def check(step: int, parallel: AutoParallel, rec: CommRecorder) -> None:
        leaves.append(engine_leaf(parallel, "first.weight"))
        if step == 1:
            engine = parallel._engine
            assert engine is not None
            del engine.leaves["extra.weight"]
            engine._stale.discard("extra.weight")
        if step + 1 < len(use):
            net.use_extra = use[step + 1]

    train_and_compare(4, net, "sgd", level, check, batches, want_losses, want_params)
    # steps 0-1: one leaf refilled; step 2: new leaves (a member had none); step 3 refills them
    assert leaves[0] is leaves[1] and leaves[1] is not leaves[2] and leaves[2] is leaves[3]


class OneRowEach(nn.Module):
    """A bucket whose members hold one row a rank at 2 ranks: `lora` ([2, 64]: used) and
    `spare` ([2, 64]: registered between used layers, never used)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.flatten, self.first = nn.Flatten(), nn.Linear(64, 32)
        self.lora = nn.Parameter(torch.randn(2, 64) * 0.1)
        self.spare = nn.Parameter(torch.randn(2, 64))
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.flatten(x)
        h = torch.relu(self.first(flat) + (flat @ self.lora.t()).sum(-1, keepdim=True))
        out: torch.Tensor = self.head(h)
        return out


class SmallConv(nn.Module):
    """A Conv2d whose bias ([4]) is one element a rank at 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(1, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.conv(x)).flatten(1))
        return out


@pytest.mark.parametrize(
    ("make", "world", "level"),
    [(OneRowEach, 2, level) for level in ("level1", "level2", "level3")]
    + [(SmallConv, 4, "level3")],
)
def test_members_of_one_row_a_rank(make: Callable[[], nn.Module], world: int, level: str) -> None:
    """Gathered in one flat message, a member of one row a rank came back as a strided view of
    the message (its rows a whole message apart): levels 1-2 then gathered the next step into
    that leaf and failed in the second step (AssertionError, no message), level 3's backward
    could not view it again ('invalid storage offset'). Losses and weights equal single-device
    training."""
    want_losses, want_params = single_device(make, "sgd", SMALL)
    net = make()
    train_and_compare(
        world, net, "sgd", level, lambda *_: None, SMALL, want_losses, want_params[-1]
    )


EVALS: dict[str, Callable[[], Any]] = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


def _freeze_around_evals(
    net: Mlp, train: Callable[[int], float], evaluate: Callable[[], None]
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train on ``SMALL[i]`` for i in 0-3 with an evaluation (`evaluate`) before layer2 is
    frozen after step 0 and before it is unfrozen after step 2: each step's loss and weights."""
    losses, params = [], []
    for i in range(4):
        if i in (1, 3):
            evaluate()
            net.layer2.requires_grad_(i == 3)
        losses.append(train(i))
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, params


@pytest.mark.parametrize("ctx", list(EVALS))
@pytest.mark.parametrize("form", ["module", "step"])
@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_frozen_and_unfrozen_after_an_evaluation(level: str, form: str, ctx: str) -> None:
    """An evaluation under ``torch.no_grad()`` (or inference mode) between steps gathers the
    weights into the leaves the step left (or makes them, level 3): a ``requires_grad_`` after
    it was ignored, those leaves kept their old ``requires_grad`` (the frozen layer was still
    updated; unfrozen, it stayed frozen). Every loss and weight equals one device's."""
    x_eval = SMALL[4][0]
    ref = Mlp(small=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def ref_train(i: int) -> float:
        loss = F.cross_entropy(ref(SMALL[i][0]), SMALL[i][1])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return loss.item()

    def ref_eval() -> None:
        with EVALS[ctx]():
            ref(x_eval)

    want_losses, want_params = _freeze_around_evals(ref, ref_train, ref_eval)
    net = Mlp(small=True)
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

        def step(x: torch.Tensor, y: torch.Tensor, train: bool) -> torch.Tensor:
            if not train:
                with EVALS[ctx]():
                    return net(x)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = AutoParallel(net if form == "module" else step, parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)

        def train(i: int) -> float:
            x, y = world.rows(SMALL[i][0]), world.rows(SMALL[i][1])
            if form == "step":
                return float(world.local(parallel(x, y, True), 0))
            loss = F.cross_entropy(parallel(x), y)  # (each rank's rows: their mean, averaged)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return sum(float(v) for v in world.local_tensors(loss.detach())) / 2

        def evaluate() -> None:
            x = world.rows(x_eval)
            if form == "step":
                parallel(x, x, False)
                return
            with EVALS[ctx]():
                parallel(x)

        losses, params = _freeze_around_evals(net, train, evaluate)
        for i in range(4):
            assert_matches_single_device(
                torch.tensor(losses[i]), torch.tensor(want_losses[i]), what=f"loss {i}"
            )
            for name, got in params[i].items():
                rows = shard_of(parallel, name, want_params[i][name])
                assert_matches_single_device(got, rows, what=f"{name} after step {i}")


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_frozen_and_unfrozen_between_backward_calls_of_one_step(level: str) -> None:
    """Gradient accumulation, two backward calls a step, layer2 frozen before the first step's
    second forward and unfrozen before the second step's: the frozen layer keeps the first
    call's gradient, the unfrozen one gets the second call's, as on one device (the leaves made
    by the step's first forward kept their ``requires_grad``: the frozen layer got both
    gradients, the unfrozen one none)."""

    def run(net: Mlp, call: Callable[[torch.Tensor], torch.Tensor], rows: Any) -> list[float]:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for s in range(2):
            for k in range(2):
                if k == 1:
                    net.layer2.requires_grad_(s == 1)
                x, y = SMALL[2 * s + k]
                loss = F.cross_entropy(call(rows(x)), rows(y))
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses

    ref = Mlp(small=True)
    want = run(ref, ref, lambda t: t)
    net = Mlp(small=True)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = AutoParallel(net, parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        got = run(net, parallel, world.rows)
        for i, loss in enumerate(got):  # (each rank's rows: their mean, averaged)
            mean = sum(float(v) for v in world.local_tensors(loss)) / 2
            assert_matches_single_device(torch.tensor(mean), want[i], what=f"loss {i}")
        for name, p in net.named_parameters():
            rows = shard_of(parallel, name, ref.get_parameter(name).detach())
            assert_matches_single_device(p.detach(), rows, what=name)
