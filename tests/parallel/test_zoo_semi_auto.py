"""Users' own models in semi_auto with no annotation: ``sw.AutoParallel(train_step,
parallel_mode="semi_auto")`` captures the whole train step (every torch op up to
``loss.backward()``), plans it (every op data parallel through DTensor's and shardwise's sharding
rules) and runs the plan on each rank.

Models (plain torch, `tests/zoo.py`): nanoGPT's GPT-2 (its ``view(-1, V)`` before the loss, the
head tied to the embedding, AdamW decay / no-decay groups), a Llama (RMSNorm, rotary, grouped
query attention, SwiGLU), a CIFAR-style ResNet (BatchNorm, max pool) and Hugging Face's
``GPT2LMHeadModel`` called with keywords (``model(input_ids=..., labels=...).loss``).

Each rank passes its own rows of the global batch; two training steps equal the single-device run
on the global batch (the loss, every gradient the optimizer applies, every parameter; 1e-5
relative), and the collectives are exactly: per step one forward AllReduce over all ranks (the
loss, a mean over the batch, made whole where it is computed) and one backward AllReduce over
all ranks (every parameter's gradient in one 25 MB bucket). The ResNet's training-mode
BatchNorms need the statistics of the whole batch: each keeps its rows split and gathers only
its per-channel statistics (one AllGather forward, a ReduceScatter backward, per layer), so the
whole network runs data parallel.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..cached import outside_worlds
from ..zoo import (
    GPT2,
    Llama,
    ResNet,
    assert_shards_match,
    gpt2_hf,
    image_batches,
    recording_step,
    semi_auto_matches,
    t5_hf,
    token_batches,
)

STEPS, BATCH = 2, 8
ADAM = {"lr": 1e-4, "eps": 1e-6}  # (see test_zoo_data_parallel.py: Adam and split rounding)

MODELS: dict[str, Any] = {
    "gpt2": (GPT2, lambda n: n.configure_optimizers(weight_decay=0.1, **ADAM), "tokens"),
    "llama": (Llama, lambda n: torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9), "tokens"),
    "resnet": (ResNet, lambda n: torch.optim.SGD(n.parameters(), lr=0.1), "images"),
    "gpt2_hf": (gpt2_hf, lambda n: torch.optim.AdamW(n.parameters(), **ADAM), "tokens"),
    "t5_hf": (t5_hf, lambda n: torch.optim.AdamW(n.parameters(), **ADAM), "tokens"),
}


def loss_of(name: str, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "gpt2_hf":
        out: torch.Tensor = net(input_ids=x, labels=x).loss
        return out
    if name == "t5_hf":  # (the decoder's inputs made from the labels: `test_fill_ops.py`)
        t5: torch.Tensor = net(input_ids=x, labels=y).loss
        return t5
    return net(x, y)[1]  # type: ignore[no-any-return]


pytestmark = pytest.mark.usefixtures("one_thread")


@outside_worlds
def data(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(STEPS, BATCH) if kind == "tokens" else image_batches(STEPS, BATCH)


@outside_worlds
def single_device(name: str) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Per step: the loss and every gradient (by name), on one device."""
    make, optimizer, kind = MODELS[name]
    net = make()
    opt = optimizer(net)
    losses, grads = [], []
    step = recording_step(net, opt, functools.partial(loss_of, name), grads)
    for x, y in data(kind):
        losses.append(step(x, y).detach())
    return losses, grads


CASES = [("gpt2", 2), ("gpt2", 4), ("gpt2", 8), ("llama", 2), ("llama", 4)]
CASES += [("resnet", 2), ("resnet", 4), ("gpt2_hf", 2), ("gpt2_hf", 4), ("t5_hf", 2)]


@pytest.mark.parametrize(("name", "world_size"), CASES)
def test_semi_auto_without_annotation_matches_one_device(name: str, world_size: int) -> None:
    make, optimizer, kind = MODELS[name]
    want_losses, want_grads = single_device(name)
    net, steps = make(), data(kind)
    with simulated_world(world_size) as world:
        world.replicate(net)
        opt = optimizer(net)
        loss_fn = functools.partial(loss_of, name)
        parallel, rec = semi_auto_matches(world, net, opt, loss_fn, steps, want_losses, want_grads)
        plan = parallel.parallel_plan
        assert plan is not None
        ranks = tuple(range(world_size))
        want = Counter(
            {
                ("AllReduce", "forward", ranks): STEPS,
                # one gradient bucket per step (each model is under 25 MB): the per-parameter
                # AllReduces (n_params per step) are one bucket now
                ("AllReduce", "backward", ranks): STEPS,
            }
        )
        if name == "resnet":
            # each of the 9 training-mode BatchNorms keeps its rows split and shares its
            # per-channel statistics: one AllGather of (mean, sum of squared deviations) per
            # layer, its adjoint a ReduceScatter in backward; the network runs data parallel
            norms = [n.name for n in plan.nodes if n.local == "split_batch_norm"]
            assert len(norms) == 9 and norms[0] == "stem.1/batch_norm", norms
            want[("AllGather", "forward", ranks)] = 9 * STEPS
            want[("ReduceScatter", "backward", ranks)] = 9 * STEPS
        assert rec.kinds() == want, rec.summary()


@outside_worlds
def gpt2_reference() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """GPT-2 on one device: the loss and every parameter after each step."""
    make, optimizer, kind = MODELS["gpt2"]
    net = make()
    opt = optimizer(net)
    losses, params = [], []
    for x, y in data(kind):
        loss = loss_of("gpt2", net, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, params


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gpt2_with_optimizer_parallel_matches_one_device(level: str, world_size: int) -> None:
    """hsdp on the plain-torch path: every parameter stored as a 1/n shard (threshold 0), its
    compute weight gathered for the ops; losses and updated parameters equal one device's (each
    rank's shard = its rows of the single-device parameter). Collectives per step: the loss's
    AllReduce, one AllGather per fused bucket forward (level 3: again in backward) and one
    ReduceScatter per bucket (level 1 at the optimizer step, levels 2-3 in backward). Every
    parameter has the default fusion id: one bucket."""
    make, optimizer, kind = MODELS["gpt2"]
    want_losses, want_params = gpt2_reference()
    batches = data(kind)
    net = make()
    with simulated_world(world_size) as world:
        world.replicate(net)
        opt = optimizer(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_of("gpt2", net, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step).hsdp(threshold=0, optimizer_level=level)
        for s, (x, y) in enumerate(batches):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want_losses[s], what=f"loss {s}")
            assert_shards_match(parallel, net, want_params[s])
            plan = parallel.optimizer_plan
            assert plan is not None
            buckets = len(plan.buckets)
            ranks = tuple(range(world_size))
            scatter = "step" if level == "level1" else "backward"  # level 1: at the step
            want = Counter(
                {
                    ("AllReduce", "forward", ranks): 1,
                    ("AllGather", "forward", ranks): buckets,
                    ("ReduceScatter", scatter, ranks): buckets,
                }
            )
            if level == "level3":
                want[("AllGather", "backward", ranks)] = buckets
            assert rec.kinds() == want, rec.summary()
