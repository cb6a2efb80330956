"""Resume equals never stopping, across plans and device counts, on real gloo processes.

Adam on a small MLP: 3 steps on 4 ranks (tensor parallel + optimizer parallel level 1), saved;
the checkpoint transformed to a 2-rank data-parallel plan with optimizer parallel level 3 and
trained 3 more steps; transformed to one device and trained 3 more with plain torch. The 9
losses equal 9 uninterrupted single-device steps, the Adam state loaded on one device is the
one the 2 ranks saved, bit for bit, and the final Adam state equals the single-device one. A
second chain loads the 4-rank checkpoint straight into the 2-rank job with `load_distributed`
before its first step. A third starts from 3 steps of ``parallel_mode="data_parallel"`` with
hsdp on 4 ranks, whose rank files hold each weight's Adam state on its owner rank only (and
record the job's 4 ranks: without the last rank's folder the checkpoint is refused); those
files go straight to one device as well as to the 2-rank plan.

The legs run in two jobs shared by the tests (`legs`): the three 4-rank legs in one, then the
four 2-rank legs in another (a process start costs seconds on 2 cores).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import run_job, simulated_world

sys.path.insert(0, str(Path(__file__).parent))
from resume_worker import FEATURES, ROWS, batches, build

WORKER = Path(__file__).parent / "resume_worker.py"


def train(net: nn.Module, opt: torch.optim.Optimizer, data: list) -> list[float]:
    out = []
    for x, y in data:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def plan_b() -> sw.planner.ParallelPlan:
    """The 2-rank plan of the worker's ``dp`` leg (planned on simulated ranks)."""
    with simulated_world(2):
        net, opt = build()

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            return loss

        parallel = AutoParallel(step, parallel_mode="semi_auto").hsdp(
            threshold=0, optimizer_level="level3"
        )
        return parallel.plan(
            shapes=[(ROWS, FEATURES), (ROWS,)], dtypes=[torch.float32, torch.int64]
        )


def uninterrupted(bias: bool = True) -> tuple[list[float], dict]:
    """One device, 9 steps without stopping: the losses and the final Adam state."""
    net, opt = build(bias)
    return train(net, opt, batches(9)), opt.state_dict()["state"]


DP_MODE = ("--plan", "dp-mode", "--threshold", "0", "--no-bias")
FIRST_LEGS = {  # 4 ranks, 3 steps each, saved under tmp/<tag>
    "a": ("--plan", "tp"),
    "p": ("--plan", "dp-mode"),
    "r": DP_MODE,
}
SECOND_LEGS = {  # 2 ranks, steps 4-6, saved under tmp/<tag>
    "b": ("--plan", "dp", "--first", "3", "--load-plain", "b_in"),  # a, transformed for plan B
    "d": ("--plan", "dp", "--first", "3", "--load", "a"),  # a, with load_distributed
    "q": ("--plan", "dp", "--first", "3", "--load-plain", "q_in"),  # p, transformed
    "s": (*DP_MODE, "--first", "3", "--load", "r"),
}


def job(tmp: Path, n: int, legs: dict[str, tuple[str, ...]]) -> dict[str, list[float]]:
    """One job of `n` ranks running `legs` one after another; the losses of each."""
    args: list[str] = []
    for tag, leg in legs.items():  # (the folder after --load / --load-plain is under tmp)
        leg = tuple(str(tmp / v) if k in ("--load", "--load-plain") else v
                    for k, v in zip(("", *leg[:-1]), leg, strict=True))  # fmt: skip
        args += [*(["+"] if args else []), *leg, "--save", str(tmp / tag)]
        args += ["--losses-out", str(tmp / f"losses_{tag}.txt")]
    res = run_job(WORKER, n, tmp / f"logs_{n}", *args, timeout=250)
    assert res.returncode == 0, res.output
    return {tag: [float(v) for v in (tmp / f"losses_{tag}.txt").read_text().split()]
            for tag in legs}  # fmt: skip


@pytest.fixture(scope="module")
def legs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[float]]]:
    """Both jobs' folders and the losses of every leg: the 4-rank legs, the two
    transformations to plan B (of tp leg a and data_parallel-mode leg p), the 2-rank legs."""
    tmp = tmp_path_factory.mktemp("resume")
    losses = job(tmp, 4, FIRST_LEGS)
    sw.checkpoint.transform(tmp / "a", tmp / "b_in", plan_b())
    sw.checkpoint.transform(tmp / "p", tmp / "q_in", plan_b())
    return tmp, {**losses, **job(tmp, 2, SECOND_LEGS)}


def one_device(
    tmp: Path, src: Path, tag: str, steps: int, bias: bool = True
) -> tuple[list[float], dict]:
    """Transform `src` to one device, load it into the plain torch network and its Adam, check
    the Adam state is the saved one exactly, and train the last 3 steps."""
    sw.checkpoint.transform(src, tmp / tag)
    net, opt = build(bias)
    ckpt = sw.load_checkpoint(tmp / tag / f"ckpt-1_{steps}.safetensors")
    assert ckpt.step == steps
    assert sw.load_param_into_net(net, ckpt, strict_load=True) == ([], [])
    sw.checkpoint.load_optimizer_state(opt, ckpt, net)
    saved = safetensors.torch.load_file(sw.checkpoint.merge(src, tmp / f"{tag}.safetensors",
                                                            optimizer=True))  # fmt: skip
    for name, p in net.named_parameters():  # carried exactly: the state the ranks saved
        for key, value in opt.state[p].items():
            assert torch.equal(value, saved[f"optimizer.state.{name}.{key}"]), (name, key)
    losses = train(net, opt, batches(9)[steps:])
    return losses, opt.state_dict()["state"]


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_resume_across_plans_equals_never_stopping(legs: tuple[Path, dict]) -> None:
    tmp, losses = legs
    want, single = uninterrupted()
    # plan B loads its own transformed files (after planning, leg b), or the 4-rank checkpoint
    # directly with load_distributed before its first step (leg d)
    for tag in ("b", "d"):
        check_continued(tmp, tag, losses["a"] + losses[tag], want, single)


def check_continued(
    tmp: Path, tag: str, got: list[float], want: list[float], single: dict, bias: bool = True
) -> None:
    """The 2-rank leg `tag` saved after step 6: on one device the last 3 steps end the 9 losses
    of one uninterrupted run (`want`) with its Adam state (`single`)."""
    last, state = one_device(tmp, tmp / tag, f"{tag}_one", 6, bias)
    got = got + last
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for index, moments in single.items():
        assert float(state[index]["step"]) == float(moments["step"]) == 9.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[index][key], moments[key], rtol=1e-5, atol=1e-7)


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_data_parallel_hsdp_checkpoint_recut_equals_never_stopping(
    legs: tuple[Path, dict], tmp_path: Path
) -> None:
    tmp, losses = legs
    want, single = uninterrupted()
    first = losses["p"]
    files = [safetensors.torch.load_file(tmp / "p" / f"rank_{r}" / "ckpt-1_3.safetensors")
             for r in range(4)]  # fmt: skip
    holders = [r for r, f in enumerate(files) if "optimizer.state.fc1.weight.exp_avg" in f]
    assert len(holders) == 1  # the weight's state on its owner rank only
    assert all("optimizer.state.fc1.bias.exp_avg" in f for f in files)  # (no owner: all ranks)
    # straight from the owner-only files to one device: the last 6 steps end the run as one
    # that never stopped, with its Adam state
    rest, state = one_device(tmp_path, tmp / "p", "p_one", 3)
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(want), rtol=1e-5, atol=0)
    for index, moments in single.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[index][key], moments[key], rtol=1e-5, atol=1e-7)
    # the 2-rank plan B loaded p's files transformed for it (leg q)
    check_continued(tmp, "q", first + losses["q"], want, single)


def state_files(src: Path, n: int, step: int) -> list[set[str]]:
    """The optimizer entries in each of the `n` rank files of `src` at `step`."""
    files = [safetensors.torch.load_file(src / f"rank_{r}" / f"ckpt-1_{step}.safetensors")
             for r in range(n)]  # fmt: skip
    return [{k for k in f if k.startswith("optimizer.")} for f in files]


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_data_parallel_hsdp_resumes_on_fewer_ranks(legs: tuple[Path, dict], tmp_path: Path) -> None:
    """Bias-free, every parameter owned: 2 weights on 4 ranks, so 2 ranks own nothing and save
    no optimizer tensor; their files still record the job's 4 ranks (without ``rank_3/`` the
    checkpoint is refused). A 2-rank data_parallel + hsdp job loads it, trains 3 steps and saves:
    each weight's state again in its owner's file only (the state loaded whole is dropped on
    the other rank), and one device ends the run like one that never stopped."""
    tmp, losses = legs
    want, single = uninterrupted(bias=False)
    held = state_files(tmp / "r", 4, 3)
    assert sorted(map(len, held)) == [0, 0, 3, 3]  # (one weight's step, exp_avg, exp_avg_sq)
    shutil.copytree(tmp / "r", tmp_path / "short")
    shutil.rmtree(tmp_path / "short" / "rank_3")
    with pytest.raises(sw.checkpoint.CheckpointError, match="of 4 ranks but the files of rank_3"):
        sw.checkpoint.transform(tmp_path / "short", tmp_path / "short_out")
    # the 2-rank data_parallel + hsdp leg s loaded r with load_distributed
    for name in ("fc1.weight", "fc2.weight"):
        holders = [
            k for k in state_files(tmp / "s", 2, 6) if f"optimizer.state.{name}.exp_avg" in k
        ]
        assert len(holders) == 1, name
    check_continued(tmp, "s", losses["r"] + losses["s"], want, single, bias=False)
