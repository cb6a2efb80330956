"""Resuming from a checkpoint continues the exact loss sequence (model + optimizer state)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_optimizer_state,
    load_param_into_net,
    save_checkpoint,
)

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
FACTORIES: dict[str, OptFactory] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-4),
}


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(123)
    return [
        (torch.randn(5, 8, generator=generator), torch.randint(0, 3, (5,), generator=generator))
        for _ in range(6)
    ]


def _train(
    net: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[float]:
    losses = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_resume_gives_bit_identical_losses(kind: str, tmp_path: Path) -> None:
    batches = _batches()
    net = _net(0)
    straight = _train(net, FACTORIES[kind](list(net.parameters())), batches)

    net = _net(0)
    opt = FACTORIES[kind](list(net.parameters()))
    first = _train(net, opt, batches[:3])
    path = save_checkpoint(net, tmp_path / "ckpt.safetensors", step=3, optimizer=opt)

    fresh = _net(99)  # different init: everything must come from the file
    fresh_opt = FACTORIES[kind](list(fresh.parameters()))
    ckpt = load_checkpoint(path)
    assert ckpt.step == 3
    assert load_param_into_net(fresh, ckpt) == ([], [])
    load_optimizer_state(fresh_opt, ckpt, fresh)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    resumed = first + _train(fresh, fresh_opt, batches[3:])
    assert resumed == straight


def test_optimizer_keys_and_mismatches(tmp_path: Path) -> None:
    net = _net(0)
    opt = torch.optim.Adam(net.parameters())
    _train(net, opt, _batches()[:1])
    path = save_checkpoint(net, tmp_path / "c.safetensors", optimizer=opt)
    ckpt = load_checkpoint(path)
    assert "0.weight" in ckpt and not any(k.startswith("optimizer.") for k in ckpt)
    assert ckpt.optimizer_state is not None
    assert "optimizer.state.0.weight.exp_avg" in ckpt.optimizer_state.tensors
    with pytest.raises(CheckpointError, match="Adam cannot be loaded into SGD"):
        load_optimizer_state(torch.optim.SGD(net.parameters(), 0.1), ckpt, net)
    with pytest.raises(CheckpointError, match="net="):
        load_optimizer_state(torch.optim.Adam(net.parameters()), ckpt)
    other = nn.Linear(8, 3)
    with pytest.raises(CheckpointError, match="parameter group 0"):
        load_optimizer_state(torch.optim.Adam(other.parameters()), ckpt, other)
    plain = load_checkpoint(save_checkpoint(net, tmp_path / "p.safetensors"))
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_optimizer_state(opt, plain, net)


def test_optimizer_saved_from_a_dict_of_parameters(tmp_path: Path) -> None:
    net = _net(0)
    params = dict(net.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.5)
    _train(net, opt, _batches()[:2])
    ckpt = load_checkpoint(save_checkpoint(params, tmp_path / "d.safetensors", optimizer=opt))
    fresh = _net(1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.5)
    load_param_into_net(fresh, ckpt)
    load_optimizer_state(fresh_opt, ckpt, fresh)
    buffers = [fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(
        torch.equal(a, opt.state[p]["momentum_buffer"])
        for a, p in zip(buffers, net.parameters(), strict=True)
    )
