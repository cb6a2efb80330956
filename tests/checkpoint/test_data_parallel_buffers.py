"""Rank files of a ``parallel_mode="data_parallel"`` job with a BatchNorm: each rank keeps its own
running statistics (as DDP without SyncBatchNorm), so the files, which hold the whole network
each and record no cut, hold different buffer values. `load_distributed`, `merge` and
`transform` refused them ("holds different values ... need src_strategy=") although nothing was
wrong; now a buffer (an entry the saved optimizer description does not list as a parameter) is
read from rank 0's file, as DDP broadcasts rank 0's buffers. Files saved without the optimizer
cannot tell buffers from blocks of a cut parameter: refused, naming the two fixes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import shardwise as sw
from shardwise import communication as comm
from shardwise.checkpoint import CheckpointError
from shardwise.testing import simulated_world

RANKS = 2


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def _rank_states() -> list[dict[str, torch.Tensor]]:
    """Each rank's state_dict after one data_parallel step on its own rows."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    net = build()
    with simulated_world(RANKS) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), 0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        sw.AutoParallel(step, parallel_mode="data_parallel")(world.rows(x), world.rows(y))
        state = net.state_dict()
        return [{k: comm.rank_parts(v)[r].clone() for k, v in state.items()} for r in range(2)]


def _save(folder: Path, optimizer: bool) -> list[dict[str, torch.Tensor]]:
    """Each rank's file as that rank of the job saves it (the whole network and, with
    `optimizer`, its SGD)."""
    states = _rank_states()
    for r, state in enumerate(states):
        net = build()
        net.load_state_dict(state)
        opt = torch.optim.SGD(net.parameters(), 0.1) if optimizer else None
        sw.save_checkpoint(net, folder / f"rank_{r}" / "c.safetensors", optimizer=opt)
    return states


def test_per_rank_batch_norm_statistics_load_as_rank_0s(tmp_path: Path) -> None:
    states = _save(tmp_path / "ck", optimizer=True)
    assert not torch.equal(states[0]["1.running_mean"], states[1]["1.running_mean"])
    assert torch.equal(states[0]["0.weight"], states[1]["0.weight"])
    net = build()
    sw.checkpoint.load_distributed(net, tmp_path / "ck", torch.optim.SGD(net.parameters(), 0.1))
    for k, v in net.state_dict().items():
        assert torch.equal(v, states[0][k]), k
    out = sw.checkpoint.merge(tmp_path / "ck", tmp_path / "m.safetensors")
    merged = safetensors.torch.load_file(out)
    assert merged.keys() == states[0].keys()
    for k, v in merged.items():
        assert torch.equal(v, states[0][k]), k


def test_files_without_the_optimizer_name_the_fixes(tmp_path: Path) -> None:
    states = _save(tmp_path / "ck", optimizer=False)
    net = build()
    with pytest.raises(CheckpointError) as info:
        sw.checkpoint.load_distributed(net, tmp_path / "ck")
    message = str(info.value)
    assert "'1.running_mean' holds different values" in message
    assert "save_checkpoint(..., optimizer=opt)" in message
    assert "load rank 0's file alone" in message
    # the second fix works: a file of such a job is the whole network
    sw.load_param_into_net(net, sw.load_checkpoint(tmp_path / "ck" / "rank_0" / "c.safetensors"))
    for k, v in net.state_dict().items():
        assert torch.equal(v, states[0][k]), k
