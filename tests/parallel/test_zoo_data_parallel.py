"""Users' own models in the data-parallel mode: ``sw.AutoParallel(train_step,
parallel_mode="data_parallel")`` on nanoGPT's GPT-2 (its AdamW decay / no-decay groups, the head
tied to the embedding), a Llama (RMSNorm, rotary, grouped-query SDPA, SwiGLU), a CIFAR-style
ResNet (BatchNorm, max pool) and Hugging Face's ``GPT2LMHeadModel`` (called with keywords,
``model(input_ids=..., labels=...).loss``), all plain torch from `tests/zoo.py`.

On 2 and 4 simulated ranks, MindSpore's input convention (each rank passes its own rows of the
global batch), two training steps: the loss, every gradient the optimizer applies and every
parameter after each step equal the single-device run (1e-5 relative), and each step issues
exactly two collectives, both AllReduce over all ranks: the one fused bucket of every gradient
(all parameters have the default fusion id and one optimizer) and the returned loss.

Dropout is 0 in the GPT models: the data-parallel mode leaves dropout to plain torch, so every
rank draws its own mask for its rows from its own generator, and no draw of the global batch's
mask on one device reproduces them.

BatchNorm: the data-parallel mode, like DDP without SyncBatchNorm, normalizes each rank's rows
with that rank's batch statistics and updates each rank's running statistics from them (the
buffers are not synchronized). A single device on the whole global batch computes other
statistics, so parity with it cannot hold in train mode. The ResNet is therefore trained in
train mode against the reference that *is* what the mode computes: one device running the
global batch as ``n`` chunks (rank r's rows), each chunk with its own copy of the BatchNorm
buffers, the loss the mean of the chunks' losses. That checks the gradients and parameters, and
rank r's running statistics against chunk r's. (Eval-mode BatchNorm would hide the statistics
entirely; GroupNorm would not be the user's model.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..cached import outside_worlds
from ..zoo import GPT2, Llama, ResNet, gpt2_hf, image_batches, token_batches

STEPS, BATCH = 2, 8
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One model: how to build it and its optimizer, its data, its loss; ``per_rank_stats``:
    BatchNorm in train mode (see the module docstring); ``tied``: ``lm_head.weight`` is
    ``transformer.wte.weight``."""

    make: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    data: Callable[[], list[Batch]]
    loss: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
    per_rank_stats: bool = False
    tied: bool = False


# Adam's first step moves every element by about lr * sign(gradient): where a gradient is near
# 0, the float32 rounding of a split batch (a sum of per-rank gradients vs one device's) flips
# it, by up to 2e-6 at lr 1e-3 / eps 1e-8 (measured on gpt2_hf, 4 ranks), so these runs use a
# smaller step and a larger eps, as tests/optim/test_data_parallel.py does
ADAM = {"lr": 1e-4, "eps": 1e-6}


def adamw(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), weight_decay=0.1, **ADAM)


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


CASES = {
    "gpt2": Case(
        GPT2,
        lambda net: net.configure_optimizers(weight_decay=0.1, **ADAM),
        lambda: token_batches(STEPS, BATCH),
        lambda net, x, y: net(x, y)[1],
        tied=True,
    ),
    "llama": Case(Llama, sgd, lambda: token_batches(STEPS, BATCH), lambda net, x, y: net(x, y)[1]),
    "resnet": Case(
        ResNet,
        sgd,
        lambda: image_batches(STEPS, BATCH),
        lambda net, x, y: net(x, y)[1],
        per_rank_stats=True,
    ),
    "gpt2_hf": Case(
        gpt2_hf,
        adamw,
        lambda: token_batches(STEPS, BATCH),
        lambda net, x, y: net(input_ids=x, labels=x).loss,
        tied=True,
    ),
}


# One intra-op thread: these models are tiny, and with two threads every convolution waits on
# the other core (ResNet forward + backward on a 2-core machine busy with other work: 1.8 s with
# 2 threads, 0.01 s with 1).
pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Run:
    """Per step: the loss, the gradients the optimizer applied and the parameters after it
    (by parameter name); with per-rank statistics, each chunk's buffers after it."""

    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]
    params: list[dict[str, torch.Tensor]]
    buffers: list[list[dict[str, torch.Tensor]]]


def record_grads(net: nn.Module, opt: torch.optim.Optimizer, into: list[Any]) -> None:
    """Keep a copy of every gradient `opt` applies: a step post-hook, so it runs after the
    data-parallel mode's step pre-hook averaged the gradients and before ``zero_grad``."""
    names = {id(p): n for n, p in net.named_parameters()}

    def hook(o: torch.optim.Optimizer, *_: Any) -> None:
        into.append(
            {names[id(p)]: p.grad.detach().clone() for g in o.param_groups for p in g["params"]}
        )

    opt.register_step_post_hook(hook)


@outside_worlds
def data(name: str) -> list[Batch]:
    """The global batches of a case (made once: a first call outside a simulated world makes
    them plain tensors)."""
    return CASES[name].data()


def use_buffers(net: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Point `net`'s buffers at the tensors of `state` (swapped, not copied into: autograd
    keeps BatchNorm's running statistics for backward, so they must not change in place)."""
    for k, b in state.items():
        mod, _, attr = k.rpartition(".")
        net.get_submodule(mod)._buffers[attr] = b


@outside_worlds
def single_device(name: str, chunks: int) -> Run:
    """The reference: one device on each global batch (as `chunks` chunks, each with its own
    BatchNorm buffers, when the case has per-rank statistics; else whole)."""
    case = CASES[name]
    net = case.make()
    opt = case.optimizer(net)
    run = Run([], [], [], [])
    record_grads(net, opt, run.grads)
    states = [{k: b.clone() for k, b in net.named_buffers()} for _ in range(chunks)]
    for x, y in data(name):
        if case.per_rank_stats:
            parts = []
            for r, (xr, yr) in enumerate(zip(x.chunk(chunks), y.chunk(chunks), strict=True)):
                use_buffers(net, states[r])  # chunk r's own tensors: updated in place
                parts.append(case.loss(net, xr, yr))
            loss = torch.stack(parts).mean()
        else:
            loss = case.loss(net, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.losses.append(loss.detach())
        run.params.append({n: p.detach().clone() for n, p in net.named_parameters()})
        run.buffers.append([{k: b.clone() for k, b in s.items()} for s in states])
    return run


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(name: str, world_size: int) -> None:
    case = CASES[name]
    want = single_device(name, world_size if case.per_rank_stats else 1)
    net, steps = case.make(), data(name)
    seen: list[dict[str, torch.Tensor]] = []
    with simulated_world(world_size) as world, CommRecorder() as rec:
        world.replicate(net)
        if case.tied:  # one Parameter, one gradient, as on one device
            assert net.lm_head.weight is net.transformer.wte.weight
        opt = case.optimizer(net)
        record_grads(net, opt, seen)
        loss_of = case.loss

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step = sw.AutoParallel(train_step, parallel_mode="data_parallel")
        assert step.network is net and step.optimizers == [opt]
        for i, (x, y) in enumerate(steps):
            loss = step(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want.losses[i], what=f"loss {i}")
            assert_matches_single_device(seen[i], want.grads[i], what=f"grads {i}")
            params = {n: p.detach() for n, p in net.named_parameters()}
            assert_matches_single_device(params, want.params[i], what=f"params after {i}")
            if case.per_rank_stats:
                buffers = {k: b for k, b in net.named_buffers()}
                for k, b in buffers.items():
                    assert_matches_single_device(
                        b, lambda r, k=k, i=i: want.buffers[i][r][k], what=f"{k} after {i}"
                    )
    group = tuple(range(world_size))
    kinds = Counter({("AllReduce", "forward", group): STEPS, ("AllReduce", "step", group): STEPS})
    assert rec.kinds() == kinds  # (the loss; the gradients, in the optimizer step)
    # (one bucket: every gradient, then 3 counts per parameter: the ranks that had one, ...)
    numel = sum(p.numel() + 3 for p in net.parameters())
    assert sorted(r.numel for r in rec.records) == sorted([1, numel] * STEPS)
