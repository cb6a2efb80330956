"""Re-cutting the checkpoint of a ``parallel_mode="data_parallel"`` job with optimizer parallel
(hsdp), whose rank files hold each parameter's optimizer state on its owner rank only.

A 4-rank job (simulated ranks, `DataParallelRunner`: the runner of
``parallel_mode="data_parallel"``, with ``parallel_optimizer=True``) trains 3 Adam steps on an
MLP whose two weights get owners (ranks 0 and 1) and whose biases are updated by every rank.
Each rank's file is written as that rank writes it in a real job: the whole weights, and the
optimizer state of the parameters it updates (`DataParallelRunner.owned`), so ranks 2 and 3 hold
the biases' state only. Merged with the optimizer, the weights and the Adam state (step, both
moments) equal 3 single-device steps; re-cut for a 2-rank semi_auto plan (or loaded directly,
or into the same 4-rank job, or exported to torch DCP and loaded by torch), training continues
with the single-device losses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import shardwise as sw
from shardwise import communication as comm
from shardwise.checkpoint import CheckpointError, export_dcp, merge, transform
from shardwise.optim import DataParallelRunner
from shardwise.parallel import AutoParallel
from shardwise.testing import assert_matches_single_device, simulated_world

ROWS, FEATURES, CLASSES, FIRST, STEPS = 8, 16, 8, 3, 6
THRESHOLD_KB = 0.5  # the weights (2 KiB, 1 KiB) get owners; the biases are updated everywhere
FILE = f"ckpt-1_{FIRST}.safetensors"
Tensors = dict[str, torch.Tensor]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


def make_net() -> MLP:
    torch.manual_seed(0)
    return MLP()


def make_opt(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.8, 0.9))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(ROWS, FEATURES, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g))
        for _ in range(STEPS)
    ]


def train(
    net: nn.Module, opt: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[float]:
    """One device: `step_of` on each batch; the losses."""
    step = step_of(net, opt)
    return [float(step(x, y).detach()) for x, y in data]


def state_entries(net: nn.Module, opt: torch.optim.Optimizer) -> Tensors:
    """The weights and the optimizer state under the checkpoint's names."""
    out = {k: v.detach().clone() for k, v in net.state_dict().items()}
    for name, p in net.named_parameters():
        for key, value in opt.state[p].items():
            out[f"optimizer.state.{name}.{key}"] = value.detach().clone()
    return out


@pytest.fixture(scope="module")
def single() -> tuple[Tensors, list[float]]:
    """One device: the entries after the first 3 steps, and the losses of the next 3."""
    net = make_net()
    opt = make_opt(net)
    train(net, opt, batches()[:FIRST])
    return state_entries(net, opt), train(net, opt, batches()[FIRST:])


def step_of(
    net: nn.Module, opt: torch.optim.Optimizer
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def save_rank(path: Path, weights: Tensors, state: dict[str, Tensors]) -> None:
    """Rank file `path` as a rank of the job writes it: its weights and optimizer holding the
    state of the parameters it updates (`state`)."""
    net = make_net()
    net.load_state_dict(weights)
    opt = make_opt(net)
    names = [n for n, _ in net.named_parameters()]
    groups = opt.state_dict()["param_groups"]
    opt.load_state_dict({"state": {names.index(n): s for n, s in state.items()},
                         "param_groups": groups})  # fmt: skip
    sw.save_checkpoint(net, path, step=FIRST, optimizer=opt)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4 rank files of the data_parallel + hsdp job after 3 steps."""
    net, data = make_net(), batches()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = make_opt(net)
        runner = DataParallelRunner(net, [opt], train_step=step_of(net, opt),
                                    parallel_optimizer=True, threshold_kb=THRESHOLD_KB)  # fmt: skip
        for x, y in data[:FIRST]:
            runner(world.rows(x), world.rows(y))
        assert runner.owners == {"fc1.weight": 0, "fc2.weight": 1}
        params = dict(net.named_parameters())
        parts = {n: comm.rank_parts(p.detach()) for n, p in net.state_dict().items()}
        states = {n: {k: comm.rank_parts(v) for k, v in opt.state[p].items()}
                  for n, p in params.items()}  # fmt: skip
        owned = [runner.owned(r) for r in range(4)]
    root = tmp_path_factory.mktemp("dp_hsdp") / "ckpt"
    for r in range(4):
        weights = {n: v[r].clone() for n, v in parts.items()}
        state = {n: {k: v[r].clone() for k, v in states[n].items()} for n in owned[r]}
        save_rank(root / f"rank_{r}" / FILE, weights, state)
    rank2 = safetensors.torch.load_file(root / "rank_2" / FILE)
    assert "optimizer.state.fc1.weight.exp_avg" not in rank2  # on its owner's file only
    assert "optimizer.state.fc1.bias.exp_avg" in rank2
    return root


def check_entries(got: Tensors, want: Tensors) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_merge_with_the_optimizer_equals_one_device(
    job: Path, single: tuple[Tensors, list[float]], tmp_path: Path
) -> None:
    want, tail = single
    out = merge(job, tmp_path / "merged.safetensors", optimizer=True)
    check_entries(safetensors.torch.load_file(out), want)
    ckpt = sw.load_checkpoint(out)  # resumed on one device: the single-device losses
    net = make_net()
    opt = make_opt(net)
    assert ckpt.step == FIRST
    assert sw.load_param_into_net(net, ckpt, strict_load=True) == ([], [])
    sw.checkpoint.load_optimizer_state(opt, ckpt, net)
    torch.testing.assert_close(train(net, opt, batches()[FIRST:]), tail, rtol=1e-5, atol=0)


def plan_2(net: nn.Module, opt: torch.optim.Optimizer) -> AutoParallel:
    parallel = AutoParallel(step_of(net, opt), parallel_mode="semi_auto")
    return parallel.hsdp(threshold=0, optimizer_level="level3")


def semi_auto_losses(src: Path, planned_first: bool) -> list[torch.Tensor]:
    """The next 3 losses of a 2-rank semi_auto job (hsdp level 3) that loads `src` after
    planning (a checkpoint cut for its plan) or before its first step."""
    net, data, out = make_net(), batches()[FIRST:], []
    with simulated_world(2) as world:
        world.replicate(net)
        opt = make_opt(net)
        if not planned_first:
            assert sw.checkpoint.load_distributed(net, src, opt) == ([], [])
        parallel = plan_2(net, opt)
        if planned_first:
            parallel.plan(shapes=[(ROWS, FEATURES), (ROWS,)], dtypes=[torch.float32, torch.int64])
            assert sw.checkpoint.load_distributed(net, src, opt) == ([], [])
        for x, y in data:
            out.append(parallel(world.rows(x), world.rows(y)))
    return out


def plan_of_two() -> sw.planner.ParallelPlan:
    with simulated_world(2):
        net = make_net()
        parallel = plan_2(net, make_opt(net))
        return parallel.plan(
            shapes=[(ROWS, FEATURES), (ROWS,)], dtypes=[torch.float32, torch.int64]
        )


def test_transform_to_two_ranks_continues_like_one_device(
    job: Path, single: tuple[Tensors, list[float]], tmp_path: Path
) -> None:
    want, tail = single
    plan = plan_of_two()
    transform(job, tmp_path / "two", plan)
    one = safetensors.torch.load_file(tmp_path / "two" / "rank_1" / FILE)
    assert one["optimizer.state.fc1.weight.exp_avg"].shape == (16, FEATURES)  # hsdp: half rows
    merged = merge(tmp_path / "two", tmp_path / "m.safetensors", optimizer=True)
    check_entries(safetensors.torch.load_file(merged), want)
    for got, loss in zip(semi_auto_losses(tmp_path / "two", True), tail, strict=True):
        assert_matches_single_device(got, torch.tensor(loss), what="loss after the re-cut")


def test_load_distributed_into_another_device_count(
    job: Path, single: tuple[Tensors, list[float]]
) -> None:
    _, tail = single
    for got, loss in zip(semi_auto_losses(job, False), tail, strict=True):
        assert_matches_single_device(got, torch.tensor(loss), what="loss after loading")


def test_the_same_job_resumes(job: Path, single: tuple[Tensors, list[float]]) -> None:
    """The 4-rank data_parallel + hsdp job loads its own checkpoint and continues."""
    _, tail = single
    net, data = make_net(), batches()[FIRST:]
    with simulated_world(4) as world:
        world.replicate(net)
        opt = make_opt(net)
        assert sw.checkpoint.load_distributed(net, job, opt) == ([], [])
        runner = DataParallelRunner(net, [opt], train_step=step_of(net, opt),
                                    parallel_optimizer=True, threshold_kb=THRESHOLD_KB)  # fmt: skip
        for (x, y), loss in zip(data, tail, strict=True):
            got = runner(world.rows(x), world.rows(y))
            assert_matches_single_device(got, torch.tensor(loss), what="resumed loss")


def drop(path: Path, name: str) -> None:
    """Rewrite rank file `path` without parameter `name`'s optimizer state (as if its rank held
    none)."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    prefix = f"optimizer.state.{name}."
    tensors = {k: v for k, v in safetensors.torch.load_file(path).items()
               if not k.startswith(prefix)}  # fmt: skip
    description = json.loads(meta["shardwise.optimizer"])
    description["tensors"] = [k for k in description["tensors"] if not k.startswith(prefix)]
    del description["state"][name]
    meta["shardwise.optimizer"] = json.dumps(description)
    sums = json.loads(meta["shardwise.checksums"])
    meta["shardwise.checksums"] = json.dumps({k: sums[k] for k in tensors})
    safetensors.torch.save_file(tensors, path, meta)


def test_state_missing_from_its_owner_is_refused(job: Path, tmp_path: Path) -> None:
    """The owner's file lacks the state its description lists: the file is named."""
    transform(job, tmp_path / "copy", 4)  # (a copy to damage; whole tensors on every rank)
    path = tmp_path / "copy" / "rank_0" / FILE
    tensors = safetensors.torch.load_file(path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    del tensors["optimizer.state.fc1.weight.exp_avg"]
    safetensors.torch.save_file(tensors, path, meta)
    with pytest.raises(CheckpointError, match=r"rank_0/.*lists entry 'optimizer.state.fc1.weight"):
        merge(tmp_path / "copy", tmp_path / "m.safetensors", optimizer=True)


def test_a_partial_piece_on_some_ranks_only_is_refused(job: Path, tmp_path: Path) -> None:
    """A cut optimizer entry whose other pieces are missing: the entry, the files holding it
    and the files lacking it are named, with the fix."""
    transform(job, tmp_path / "two", plan_of_two())
    drop(tmp_path / "two" / "rank_1" / FILE, "fc1.weight")
    with pytest.raises(CheckpointError) as err:
        transform(tmp_path / "two", tmp_path / "one")
    message = str(err.value)
    assert "optimizer entry 'optimizer.state.fc1.weight." in message
    assert f"{tmp_path / 'two' / 'rank_0' / FILE} only, not in {tmp_path / 'two' / 'rank_1'}" in (
        message
    )
    assert "put back every rank's file" in message
    assert not (tmp_path / "one").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_export_to_torch_dcp_continues_like_one_device(
    job: Path, single: tuple[Tensors, list[float]], tmp_path: Path
) -> None:
    """torch's own ``dcp.load`` (one process) reads the exported owner-only checkpoint into a
    plain MLP and Adam: the single-device weights and state, and the next 3 losses."""
    want, tail = single
    export_dcp(job, tmp_path / "dcp")
    net = make_net()
    opt = make_opt(net)
    msd, osd = get_model_state_dict(net), get_optimizer_state_dict(net, opt)
    dcp.load({**msd, "optimizer": osd}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    set_model_state_dict(net, msd)
    set_optimizer_state_dict(net, opt, osd)
    check_entries(state_entries(net, opt), want)
    torch.testing.assert_close(train(net, opt, batches()[FIRST:]), tail, rtol=1e-5, atol=0)
