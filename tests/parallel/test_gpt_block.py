"""A GPT-style block under Megatron-style strategies (`testing.models`), 8 (and 4) simulated ranks.

The block: vocab-parallel embedding (Gather, masked lookup), causal attention with BatchMatMul /
Softmax / Dropout (heads over mp), row-parallel projection, GeLU MLP (column- then
row-parallel), two LayerNorms, dropout on the MLP output, a head and a cross-entropy loss. For
each step the loss, every parameter block and every gradient block equal the single-device run
with the same seed (dropout masks included), and the collectives are exactly the ones the
strategies imply, forward and backward.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan
from shardwise.testing import (
    CommRecorder,
    SimulatedWorld,
    assert_matches_single_device,
    simulated_world,
)
from shardwise.testing.models import GPTBlock, GPTConfig, gpt_batches, megatron_strategies

WORLD, BATCH, STEPS, LR = 8, 8, 2, 0.5
CFG = GPTConfig()
W = tuple(range(WORLD))

# dp=2, mp=4 on the global matrix (g0, g1) = (2, 4): dp = g0, mp = g1 (the embedding's
# ((mp, 1), (dp, 1)) puts its batch on dp, outer, and its rows on mp, as MindSpore's split-batch
# Gather does). Groups are those holding rank 0.
MP, DP = (0, 1, 2, 3), (0, 4)
FORWARD = Counter(
    {
        # ids (data parallel over all 8) -> split over dp only for the lookup: one AllGather over
        # mp (two before: the old ((mp, 1), (1, 1)) looked up the whole batch on every rank)
        ("AllGather", "forward", MP): 1,
        # embedding (masked lookup, rows on mp), row-parallel proj and fc2: over mp
        ("AllReduce", "forward", MP): 3,
        # logits (dp, mp) -> the loss's rows over all 8: one AlltoAll over mp (an AllGather and
        # an AlltoAll before, on the old (2, 2, 2) matrix)
        ("AlltoAll", "forward", MP): 1,
        ("AllReduce", "forward", W): 1,  # ReduceMean of the per-token losses
    }
)
BACKWARD = Counter(
    {
        ("AllReduce", "backward", W): 1,  # the mean's adjoint (the module form's seed)
        ("AlltoAll", "backward", MP): 1,  # adjoint of the logits redistribution
        # the gradients of ln1's, ln2's and res2's outputs averaged over mp where the
        # column-parallel q/k/v, fc1 and head read them (Megatron's f); the adjoints of the
        # embedding's, proj's and fc2's AllReduces are then local (they were these 3 before)
        ("AllReduce", "backward", MP): 3,
        # every gradient over dp in one bucket: wq wk wv wo w1 b1 w2 w_head and the embedding
        # (split over mp; the embedding had its own bucket before), and the position and
        # ln1/ln2 gamma and beta, equal over mp now (a bucket over all 8 ranks before)
        ("AllReduce", "backward", DP): 1,
    }
)


def single_device(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses; parameters and gradients after each backward (before the SGD update)."""
    net = GPTBlock(CFG)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    torch.manual_seed(0)
    losses, states = [], []
    for ids, onehot in batches:
        loss = net(ids, onehot)
        loss.backward()
        state = {n: p.detach().clone() for n, p in net.named_parameters()}
        states.append(state | {f"{n}.grad": p.grad.clone() for n, p in net.named_parameters()})
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, states


def check_blocks(net: GPTBlock, plan: ParallelPlan, state: dict[str, torch.Tensor]) -> None:
    for name, p in net.named_parameters():
        layout, shape = plan.param_layouts()[name]
        assert p.grad is not None, name
        for what, value, full in ((name, p.detach(), state[name]), (f"{name}.grad", p.grad, None)):
            full = state[what] if full is None else full
            assert_matches_single_device(
                value, lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)], what=what
            )


def train_step_form(world: SimulatedWorld, net: GPTBlock) -> AutoParallel:
    """`net` replicated in `world`, wrapped in the train-step form: forward, ``loss.backward()``
    and an SGD step inside the wrapped call, which takes the global batch on every rank."""
    world.replicate(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def train_step(ids: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = net(ids, onehot)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return AutoParallel(train_step)


def test_gpt_block_megatron_matches_single_device() -> None:
    batches = gpt_batches(CFG, BATCH, STEPS)
    losses, states = single_device(batches)
    net = GPTBlock(CFG, megatron_strategies(2, 4))
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = AutoParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        torch.manual_seed(0)
        for step, (ids, onehot) in enumerate(batches):
            with CommRecorder() as rec:
                loss = parallel(world.rows(ids), world.rows(onehot))
                loss.backward()
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            assert rec.kinds() == FORWARD + BACKWARD, rec.summary()
            assert parallel.parallel_plan is not None
            check_blocks(net, parallel.parallel_plan, states[step])
            opt.step()
            opt.zero_grad()


def test_gpt_block_train_step_needs_no_allreduce_for_the_loss_backward() -> None:
    """The train-step form calls ``loss.backward()`` inside the wrapped call: the ReduceMean's
    AllReduce (the loss) gets a seed of ones on every rank, so its adjoint AllReduce is skipped
    (docs/parallel.md); every other collective is the network form's, and so are the losses."""
    batches = gpt_batches(CFG, BATCH, STEPS)
    losses, _ = single_device(batches)
    net = GPTBlock(CFG, megatron_strategies(2, 4))
    want = FORWARD + BACKWARD
    want[("AllReduce", "backward", W)] -= 1
    with simulated_world(WORLD) as world:
        parallel = train_step_form(world, net)
        torch.manual_seed(0)
        for step, (ids, onehot) in enumerate(batches):
            with CommRecorder() as rec:
                loss = parallel(world.rows(ids), world.rows(onehot))
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            assert rec.kinds() == want, rec.summary()


@pytest.mark.parametrize(("dp", "mp"), [(4, 2), (1, 4)])
def test_gpt_block_train_step_other_grids(dp: int, mp: int) -> None:
    """The train-step form (global batch on every rank, split by the dataset strategy) on other
    dp x mp grids (1 x 4: the repeat factor 2 appended): loss and every parameter block after
    each update."""
    batches = gpt_batches(CFG, BATCH, STEPS)
    losses, states = single_device(batches)
    net = GPTBlock(CFG, megatron_strategies(dp, mp))
    with simulated_world(WORLD) as world:
        parallel = train_step_form(world, net)
        torch.manual_seed(0)
        for step, (ids, onehot) in enumerate(batches):
            loss = parallel(world.rows(ids), world.rows(onehot))
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            plan = parallel.parallel_plan
            assert plan is not None
            if step + 1 < STEPS:  # parameters after this update = before the next backward
                for name, p in net.named_parameters():
                    layout, shape = plan.param_layouts()[name]
                    full = states[step + 1][name]
                    assert_matches_single_device(
                        p.detach(), lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)]
                    )


# dp=2, mp=2 on 4 ranks: (g0, g1) = (2, 2), dp = g0, mp = g1; groups holding rank 0.
W4, MP2, DP2 = (0, 1, 2, 3), (0, 1), (0, 2)
# The train-step form at 2 x 2, written out: bench/gpt_block.py's `megatron_bound` counts 11
# (6 AllReduce over mp, 2 AlltoAll over mp, 1 AllGather of the ids, the loss value over all
# ranks, one gradient bucket over dp); these are those 11 and nothing else.
BOUND_2X2 = Counter(
    {
        ("AllGather", "forward", MP2): 1,  # ids, split over dp only for the lookup
        ("AllReduce", "forward", MP2): 3,  # embedding, proj, fc2 outputs
        ("AlltoAll", "forward", MP2): 1,  # logits vocab columns -> token rows
        ("AllReduce", "forward", W4): 1,  # the loss value
        ("AlltoAll", "backward", MP2): 1,  # and back
        ("AllReduce", "backward", MP2): 3,  # gradients at the q/k/v, fc1 and head inputs
        ("AllReduce", "backward", DP2): 1,  # every parameter's mp-block, one bucket
    }
)


def test_gpt_block_2x2_train_step_is_the_megatron_bound() -> None:
    """dp 2 x mp 2 on 4 ranks, train-step form: exactly the 11 collectives above each step, and
    the loss and every gradient block (read inside the step, before the update) equal the
    single-device run's."""
    batches = gpt_batches(CFG, BATCH, STEPS)
    losses, states = single_device(batches)
    net = GPTBlock(CFG, megatron_strategies(2, 2))
    grads: dict[str, torch.Tensor] = {}
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR)

        def train_step(ids: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(ids, onehot)
            loss.backward()
            grads.update(
                {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            )
            opt.step()
            opt.zero_grad()
            return loss

        parallel = AutoParallel(train_step)
        torch.manual_seed(0)
        for step, (ids, onehot) in enumerate(batches):
            grads.clear()
            with CommRecorder() as rec:
                loss = parallel(world.rows(ids), world.rows(onehot))
            assert rec.kinds() == BOUND_2X2, rec.summary()
            assert sum(rec.kinds().values()) == 11
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            plan = parallel.parallel_plan
            assert plan is not None
            assert set(grads) == {n for n, _ in net.named_parameters()}
            for name, grad in grads.items():
                layout, shape = plan.param_layouts()[name]
                full = states[step][f"{name}.grad"]
                assert_matches_single_device(
                    grad, lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)], what=name
                )
