"""Checkpoints written inside `simulated_world(n)`: one process writes one file for every rank.

A data-parallel job (semi_auto, nothing annotated) holds the same weights and optimizer state
on every rank, so `Model.train` with `ModelCheckpoint` saves, and one device resumes from the
file with the losses of an uninterrupted single-device run. A network whose ranks hold
different blocks (a column-parallel ``nn.Linear``) cannot go in one file: the error names the
entry and the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import simulated_world

ROWS, STEPS, FIRST, LR = 8, 4, 2, 0.05


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g))
            for _ in range(STEPS)]  # fmt: skip


def one_device(net: nn.Module, opt: torch.optim.Optimizer, data: list) -> list[float]:
    out = []
    for x, y in data:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.fixture
def semi_auto() -> object:
    sw.set_auto_parallel_context(
        parallel_mode=sw.ParallelMode.SEMI_AUTO_PARALLEL, dataset_strategy="data_parallel"
    )
    yield
    sw.reset_auto_parallel_context()


@pytest.mark.usefixtures("semi_auto")
def test_model_checkpoint_of_a_data_parallel_job_resumes_on_one_device(tmp_path: Path) -> None:
    data = batches()
    base = make_net()
    want = one_device(base, torch.optim.Adam(base.parameters(), lr=LR), data)
    net = make_net()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.Adam(net.parameters(), lr=LR)
        model = sw.Model(net, nn.CrossEntropyLoss(), opt)
        saver = sw.train.ModelCheckpoint("mlp", tmp_path, sw.train.CheckpointConfig(FIRST))
        model.train(1, [(world.rows(x), world.rows(y)) for x, y in data[:FIRST]],
                    callbacks=[saver])  # fmt: skip
    assert saver.latest == tmp_path / f"mlp-1_{FIRST}.safetensors"  # one file for the job
    ckpt = sw.load_checkpoint(saver.latest)
    again = make_net()
    assert sw.load_param_into_net(again, ckpt, strict_load=True) == ([], [])
    opt = torch.optim.Adam(again.parameters(), lr=LR)
    sw.checkpoint.load_optimizer_state(opt, ckpt, again)
    got = one_device(again, opt, data[FIRST:])
    torch.testing.assert_close(got, want[FIRST:], rtol=1e-5, atol=0)


def test_blocks_that_differ_between_ranks_name_the_entry_and_the_fix(tmp_path: Path) -> None:
    (x, y), net = batches()[0], make_net()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        sw.shard(net[0], in_strategy=((1, 1), (4, 1)))  # column-parallel: weight rows split

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(inputs), targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        sw.AutoParallel(step, parallel_mode="semi_auto")(world.rows(x), world.rows(y))
        with pytest.raises(sw.checkpoint.CheckpointError, match=r"'0\.weight'.*rank_parts"):
            sw.save_checkpoint(net, tmp_path / "net.safetensors")
    assert not list(tmp_path.iterdir())  # nothing half written
