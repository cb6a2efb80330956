"""Resuming from a checkpoint continues the exact loss sequence (model + optimizer state)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_optimizer_state,
    load_param_into_net,
    save_checkpoint,
)
from shardwise.testing import assert_matches_single_device, simulated_world

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


def _step_of(net: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """A train step ``step(x, y)``: cross entropy of `net`, backward, `opt`'s step."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


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


def _wrapped(net: nn.Module, how: str) -> nn.Module:
    if how == "compile":
        return torch.compile(net)  # (state_dict names "_orig_mod.…"; never run here)
    return sw.AutoParallel(net, parallel_mode="semi_auto")  # (names "network.…")


@pytest.mark.parametrize(
    ("how", "saved_wrapped"), [("auto_parallel", True), ("auto_parallel", False), ("compile", True)]
)
def test_resume_under_a_wrapper_prefix(how: str, saved_wrapped: bool, tmp_path: Path) -> None:
    """A checkpoint saved through a wrapper (every name under its prefix) resumes the bare
    network with `load_param_into_net` + `load_optimizer_state`, and a bare one the wrapper:
    a prefix on every name is not another network. The losses are the uninterrupted run's."""
    batches = _batches()
    net = _net(0)
    straight = _train(net, FACTORIES["adam"](list(net.parameters())), batches)
    net = _net(0)
    opt = FACTORIES["adam"](list(net.parameters()))
    first = _train(net, opt, batches[:3])
    saved = _wrapped(net, how) if saved_wrapped else net
    path = save_checkpoint(saved, tmp_path / "ckpt.safetensors", optimizer=opt)

    fresh = _net(99)
    fresh_opt = FACTORIES["adam"](list(fresh.parameters()))
    target = fresh if saved_wrapped else _wrapped(fresh, how)
    ckpt = load_checkpoint(path)
    assert load_param_into_net(target, ckpt) == ([], [])
    load_optimizer_state(fresh_opt, ckpt, target)
    assert first + _train(fresh, fresh_opt, batches[3:]) == straight


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


def test_loaded_optimizer_state_is_its_own_copy(tmp_path: Path) -> None:
    """Training after `load_optimizer_state` leaves the Checkpoint as saved, and two
    optimizers loaded from one Checkpoint hold separate state."""
    net = _net(0)
    opt = torch.optim.Adam(net.parameters(), lr=torch.tensor(0.01))
    _train(net, opt, _batches()[:1])
    ckpt = load_checkpoint(save_checkpoint(net, tmp_path / "c.safetensors", optimizer=opt))
    assert ckpt.optimizer_state is not None
    saved = {k: v.clone() for k, v in ckpt.optimizer_state.tensors.items()}
    runs = []
    for _ in range(2):
        fresh = _net(1)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=torch.tensor(0.01))
        load_param_into_net(fresh, ckpt)
        load_optimizer_state(fresh_opt, ckpt, fresh)
        runs.append((fresh, fresh_opt))
    first, first_opt = runs[0]
    _train(first, first_opt, _batches()[1:3])
    assert ckpt.optimizer_state.tensors.keys() == saved.keys()
    assert all(torch.equal(ckpt.optimizer_state.tensors[k], v) for k, v in saved.items())
    second, second_opt = runs[1]
    weight = "optimizer.state.0.weight.exp_avg"
    assert torch.equal(second_opt.state[second[0].weight]["exp_avg"], saved[weight])
    assert second_opt.state[second[0].weight]["step"] == 1


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


@pytest.mark.parametrize("plan", ["data_parallel", "hsdp_level3", "megatron_level1", "megatron"])
def test_whole_file_loaded_before_the_first_parallel_call(plan: str, tmp_path: Path) -> None:
    """A one-device checkpoint (weights and Adam state) loaded with `load_param_into_net` and
    `load_optimizer_state` into a network before its first parallel call (simulated ranks):
    the run continues with the one-device losses. The state was one plain tensor all simulated
    ranks updated (N updates a step: losses off from the second step on), and hsdp could not
    cut it ('LocalIntNode' has no attribute 'guard_int')."""
    batches = [(x[:4], y[:4]) for x, y in _batches()]
    net = _net(0)
    opt = FACTORIES["adam"](list(net.parameters()))
    _train(net, opt, batches[:2])
    path = save_checkpoint(net, tmp_path / "whole.safetensors", step=2, optimizer=opt)
    want = _train(net, opt, batches[2:])

    net = _net(99)
    with simulated_world(4 if plan.startswith("megatron") else 2) as world:
        world.replicate(net)
        opt = FACTORIES["adam"](list(net.parameters()))
        if plan.startswith("megatron"):
            sw.shard(net[0], in_strategy=((2, 1), (2, 1)))  # column parallel
            sw.shard(net[2], in_strategy=((2, 2), (1, 2)))  # row parallel
        ckpt = load_checkpoint(path)
        assert load_param_into_net(net, ckpt, strict_load=True) == ([], [])
        load_optimizer_state(opt, ckpt, net)

        step = _step_of(net, opt)
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        if plan != "data_parallel" and plan != "megatron":
            parallel.hsdp(threshold=0, optimizer_level=plan.split("_")[1])
        got = [parallel(world.rows(x), world.rows(y)) for x, y in batches[2:]]
    for i, loss in enumerate(got):
        assert_matches_single_device(loss, torch.tensor(want[i]), what=f"loss {i}")


def test_saving_between_plan_and_the_first_hsdp_step_names_the_cause(tmp_path: Path) -> None:
    """A whole checkpoint loaded, the network planned with hsdp but no step taken: the Adam
    state is still whole (hsdp cuts it at the first step), so saving the rank's file is refused
    naming that and the fix; after one step it saves."""
    net = _net(0)
    opt = FACTORIES["adam"](list(net.parameters()))
    _train(net, opt, _batches()[:1])
    path = save_checkpoint(net, tmp_path / "whole.safetensors", optimizer=opt)
    x, y = _batches()[1]
    with sw.communication.dry_run(2, rank=1):
        net = _net(99)
        opt = FACTORIES["adam"](list(net.parameters()))
        ckpt = load_checkpoint(path)
        load_param_into_net(net, ckpt)
        load_optimizer_state(opt, ckpt, net)

        step = _step_of(net, opt)
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto").hsdp(threshold=0)
        parallel.plan(shapes=[(4, 8), (4,)], dtypes=[torch.float32, torch.int64])
        rank_file = tmp_path / "job" / "rank_1" / "c.safetensors"
        fix = (
            r"'optimizer\.state\.0\.weight\.exp_avg' has shape \[16, 8\], not this rank's hsdp "
            r"shard \[8, 8\] of '0\.weight'.*at the first step; take one step before saving"
        )
        with pytest.raises(CheckpointError, match=fix):
            save_checkpoint(net, rank_file, optimizer=opt)
        parallel(x[:2], y[:2])
        save_checkpoint(net, rank_file, optimizer=opt)
    saved = load_checkpoint(rank_file)
    assert saved.optimizer_state is not None
    assert saved.optimizer_state.tensors["optimizer.state.0.weight.exp_avg"].shape == (8, 8)
