"""Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) under a plan.

The region's ops are plan nodes in the forward; its recomputation in backward replays the plan
from the region's first node (`parallel/_recompute.py`): the same moves and collectives (again,
in the backward phase), this rank's blocks of the same global dropout masks. Before, the capture
refused checkpointing, and checkpointing turned on after planning was refused at its first op.
Reentrant checkpointing (``use_reentrant=True``, Hugging Face's default) replays the same way;
its backward runs a backward of its own, whose parameter gradients fill the same buckets (they
were all-reduced one by one).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import shardwise as sw
from shardwise.parallel import UnsupportedParallelError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

STEPS, SEED = 3, 5
pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.3, self.training))


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op == torch.ops.aten.addmm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective() -> Any:
    return create_selective_checkpoint_contexts(_policy)


class Net(nn.Module):
    """Two residual blocks with dropout, each in a checkpoint region when `how` says so."""

    def __init__(self, how: str = "non-reentrant") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)  # (a reentrant region's input must require grad)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            if self.how == "factory first":  # (the region's first node makes a tensor)
                x = checkpoint(lambda h, b=block: b(h + torch.arange(8.0)), x, use_reentrant=False)
            elif self.how == "no rng":  # (torch's recomputation draws new masks)
                x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
            elif self.how == "selective":  # (torch's SAC: matmuls saved, the rest recomputed)
                x = checkpoint(block, x, use_reentrant=False, context_fn=_selective)
            elif self.how == "nested":
                x = checkpoint(lambda h, b=block: checkpoint(b, h, use_reentrant=False), x,
                               use_reentrant=False)  # fmt: skip
            elif self.how:
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
            else:
                x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def cross_entropy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x), y)


def trainer(net: nn.Module, seen: list[dict[str, torch.Tensor]]) -> Any:
    """`zoo.recording_step` with SGD and a cross entropy."""
    from ..zoo import recording_step

    return recording_step(net, torch.optim.SGD(net.parameters(), lr=0.1), cross_entropy, seen)


def one_device(how: str = "") -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    (x, y), grads = batch(), []
    step = trainer(Net(how), grads)  # (without: the same masks, as checkpointing restores RNG)
    torch.manual_seed(SEED)
    return [step(x, y).detach() for _ in range(STEPS)], grads


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "factory first", "no rng"])
def test_data_parallel_with_dropout_in_checkpointed_blocks_matches_one_device(how: str) -> None:
    """``no rng``: torch's recomputation draws new masks from the generator as it is then (the
    gradient of other masks than the forward's, on one device too): the replay does the same.
    ``reentrant``: the region's backward runs a backward of its own, whose parameter gradients
    fill the same bucket (8 AllReduces of one parameter each, before)."""
    want, want_grads = one_device(how)  # (checkpointed on one device too)
    (x, y), seen, net = batch(), [], Net(how)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net, seen))
        torch.manual_seed(SEED)
        with CommRecorder() as rec:
            for s in range(STEPS):
                loss = parallel(world.rows(x), world.rows(y))
                assert_matches_single_device(loss, want[s], what=f"loss {s}")
                assert_matches_single_device(seen[s], want_grads[s], what=f"grads {s}")
    # (nothing to recompute but local ops: the loss and the gradient bucket, as without)
    assert rec.kinds() == Counter(
        {("AllReduce", "forward", (0, 1)): STEPS, ("AllReduce", "backward", (0, 1)): STEPS}
    )


def megatron(net: Net) -> None:
    for block in net.blocks:
        sw.shard(block.fc1, in_strategy=((2, 1), (2, 1)))
        sw.shard(block.fc2, in_strategy=((2, 2), (1, 2)))


def run_megatron(how: str) -> tuple[list[torch.Tensor], Counter[Any]]:
    (x, y), net = batch(), Net(how)
    with simulated_world(4) as world:
        world.replicate(net)
        megatron(net)
        parallel = sw.AutoParallel(trainer(net, []))
        torch.manual_seed(SEED)
        with CommRecorder() as rec:
            losses = [parallel(world.rows(x), world.rows(y)) for _ in range(STEPS)]
        recomputed = Counter(r.kind for r in rec.records if r.label.startswith("recompute from"))
    return losses, recomputed


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_megatron_with_dropout_in_checkpointed_blocks_matches_one_device(how: str) -> None:
    """The recomputation runs each block's collectives again: the AllGather of its input
    before the column-parallel layer; the row-parallel ReduceScatter too when reentrant
    (torch's non-reentrant recomputation stops before it: backward does not need its result)."""
    want, _ = one_device()
    losses, recomputed = run_megatron(how)
    for s in range(STEPS):
        assert_matches_single_device(losses[s], want[s], what=f"loss {s}")
    again = {"AllGather": 2 * STEPS} | ({"ReduceScatter": 2 * STEPS} if how == "reentrant" else {})
    assert recomputed == Counter(again)
    _, without = run_megatron("")
    assert without == Counter()


@pytest.mark.parametrize(
    ("level", "how"),
    [
        ("level2", "non-reentrant"),
        ("level3", "non-reentrant"),
        ("level2", "reentrant"),
        ("level2", "selective"),
        ("level3", "selective"),
    ],
)
def test_with_optimizer_parallel(level: str, how: str) -> None:
    """Level 2 replays (the weights are gathered once per step). Level 3 frees the gathered
    weights after the forward: the recomputation gathers a bucket again in backward, once,
    shared with the re-gather of the weights autograd saved outside the regions (it was
    refused). Reentrant regions (a backward inside backward) are refused naming what works.
    Selective checkpointing at level 3 crashed: the gather ran inside torch's recomputation
    mode, which refuses ops its forward did not run (the weights are now filled before)."""
    want, _ = one_device()
    (x, y), net = batch(), Net(how)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net, [])).hsdp(threshold=0, optimizer_level=level)
        torch.manual_seed(SEED)
        if how == "reentrant":
            with pytest.raises(UnsupportedParallelError, match=r"use_reentrant=False"):
                parallel(world.rows(x), world.rows(y))
            return
        with CommRecorder() as rec:
            for s in range(STEPS):
                loss = parallel(world.rows(x), world.rows(y))
                assert_matches_single_device(loss, want[s], what=f"loss {s}")
        plan = parallel.optimizer_plan
        assert plan is not None
        buckets, ranks = len(plan.buckets), (0, 1)
        kinds = {
            ("AllReduce", "forward", ranks): STEPS,  # (the loss)
            ("AllGather", "forward", ranks): buckets * STEPS,
            ("ReduceScatter", "backward", ranks): buckets * STEPS,
        }
        if level == "level3":  # (each bucket once in backward: recomputation and saved weights)
            kinds[("AllGather", "backward", ranks)] = buckets * STEPS
        assert rec.kinds() == Counter(kinds), rec.summary()


def test_nested_regions_are_refused_at_capture() -> None:
    from shardwise.planner import CaptureError

    (x, y), net = batch(), Net("nested")
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net, []))
        with pytest.raises(
            CaptureError, match=r"linear at .* inside another .*one after the other"
        ):
            parallel(world.rows(x), world.rows(y))


def test_turned_on_after_planning() -> None:
    """``model.gradient_checkpointing_enable()`` after the first step runs the same ops: the
    regions replay, non-reentrant (step 1) or reentrant (step 2)."""
    want, want_grads = one_device()
    (x, y), seen, net = batch(), [], Net("")
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net, seen))
        torch.manual_seed(SEED)
        for s in range(STEPS):
            net.how = ["", "non-reentrant", "reentrant"][s]
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
            assert_matches_single_device(seen[s], want_grads[s], what=f"grads {s}")


@pytest.mark.parametrize(
    ("reentrant", "level"),
    [(False, None), (True, None), (False, "level3")],
    ids=["non-reentrant", "reentrant", "non-reentrant-hsdp-level3"],
)
def test_hugging_face_gradient_checkpointing_matches_one_device(
    reentrant: bool, level: str | None
) -> None:
    """HF GPT-2 with dropout and ``gradient_checkpointing_enable`` (reentrant: its default),
    and with optimizer parallel level 3 (every weight a shard, gathered again in backward for
    the recomputation: the losses after each update equal one device's)."""
    from ..zoo import gpt2_hf, token_batches

    def make() -> nn.Module:
        model = gpt2_hf(dropout=0.1)
        kwargs = {"use_reentrant": reentrant}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model

    def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = net(input_ids=x, labels=x).loss
        return out

    batches = token_batches(2, 8)
    ref, grads = make(), []
    step = trainer_of(ref, loss_of, grads)
    torch.manual_seed(SEED)
    want = [step(x, y).detach() for x, y in batches]
    net, seen = make(), []
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer_of(net, loss_of, seen))
        if level is not None:
            parallel.hsdp(threshold=0, optimizer_level=level)
        torch.manual_seed(SEED)
        for s, (x, y) in enumerate(batches):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
            if level is None:  # (with hsdp the gradients are shards)
                assert_matches_single_device(seen[s], grads[s], what=f"grads {s}")


def trainer_of(net: nn.Module, loss_of: Any, seen: list[dict[str, torch.Tensor]]) -> Any:
    from ..zoo import recording_step

    return recording_step(net, torch.optim.AdamW(net.parameters(), lr=1e-3), loss_of, seen)


class _Boom(torch.autograd.Function):
    """Identity; its backward raises while `armed`."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if _Boom.armed:
            raise RuntimeError("boom")
        return g


def test_level3_after_a_backward_that_raised_and_a_step() -> None:
    """Level 3 with checkpointed blocks: a backward raises after a region was recomputed, the
    step catches it and still steps the optimizer; the next step runs and its loss equals a
    fresh run's from the same parameters (it raised ``KeyError`` for a weight the step had
    dropped)."""

    class Boomed(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.blocks[0], self.inp(x), use_reentrant=False)
            x = checkpoint(self.blocks[1], _Boom.apply(x), use_reentrant=False)
            out: torch.Tensor = self.head(x)
            return out

    (x, y), net = batch(), Boomed()
    net.eval()  # (no dropout: the losses compare across runs)
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(a), b)
            with contextlib.suppress(RuntimeError):  # (a skip-bad-batch loop: still steps)
                loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step).hsdp(threshold=0, optimizer_level="level3")
        losses = []
        for armed in (False, True, False):
            _Boom.armed = armed
            losses.append(parallel(world.rows(x), world.rows(y)))
        _Boom.armed = False
    ref = Boomed()
    ref.eval()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for armed in (False, True, False):
        loss = F.cross_entropy(ref(x), y)
        if not armed:
            loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.detach())
    for s in (0, 2):
        assert_matches_single_device(losses[s], want[s], what=f"loss {s}")


class InputRegion(nn.Module):
    """A residual block checkpointed on the network's input itself (it needs no gradient):
    the plan's first op runs inside the region."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head = Block(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(checkpoint(self.block, x, use_reentrant=False))
        return out


@pytest.mark.parametrize("threshold", [0, 10**9], ids=["sharded", "nothing sharded"])
def test_level3_with_a_region_on_the_raw_input(threshold: int) -> None:
    """Level 3's saved-tensor hooks were pushed at the plan's first op, here inside the
    region: the region's end popped them in place of its own, whose hooks then saved the rest
    of the forward too (``CheckpointError``: more tensors saved in the forward than recomputed).
    They are pushed around the call now."""
    (x, y), seen = batch(), []
    step = trainer(InputRegion(), seen)
    torch.manual_seed(SEED)
    want = [step(x, y).detach() for _ in range(STEPS)]
    net = InputRegion()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net, [])).hsdp(
            threshold=threshold, optimizer_level="level3"
        )
        torch.manual_seed(SEED)
        for s in range(STEPS):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
