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


def leg(tmp: Path, n: int, tag: str, *args: str) -> list[float]:
    losses = tmp / f"losses_{tag}.txt"
    res = run_job(WORKER, n, tmp / f"logs_{tag}", *args, "--losses-out", str(losses), timeout=150)
    assert res.returncode == 0, res.output
    return [float(v) for v in losses.read_text().split()]


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
@pytest.mark.timeout(400)
def test_resume_across_plans_equals_never_stopping(tmp_path: Path) -> None:
    want, single = uninterrupted()
    first = leg(tmp_path, 4, "a", "--plan", "tp", "--save", str(tmp_path / "a"))
    sw.checkpoint.transform(tmp_path / "a", tmp_path / "b_in", plan_b())
    # plan B loads its own transformed files (after planning), or the 4-rank checkpoint
    # directly with load_distributed before its first step
    for tag, how, where in (("b", "--load-plain", "b_in"), ("d", "--load", "a")):
        got = first + leg(tmp_path, 2, tag, "--plan", "dp", "--first", "3", how,
                          str(tmp_path / where), "--save", str(tmp_path / tag))  # fmt: skip
        check_continued(tmp_path, tag, got, want, single)


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
@pytest.mark.timeout(300)
def test_data_parallel_hsdp_checkpoint_recut_equals_never_stopping(tmp_path: Path) -> None:
    want, single = uninterrupted()
    first = leg(tmp_path, 4, "p", "--plan", "dp-mode", "--save", str(tmp_path / "p"))
    files = [safetensors.torch.load_file(tmp_path / "p" / f"rank_{r}" / "ckpt-1_3.safetensors")
             for r in range(4)]  # fmt: skip
    holders = [r for r, f in enumerate(files) if "optimizer.state.fc1.weight.exp_avg" in f]
    assert len(holders) == 1  # the weight's state on its owner rank only
    assert all("optimizer.state.fc1.bias.exp_avg" in f for f in files)  # (no owner: all ranks)
    # straight from the owner-only files to one device: the last 6 steps end the run as one
    # that never stopped, with its Adam state
    rest, state = one_device(tmp_path, tmp_path / "p", "p_one", 3)
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(want), rtol=1e-5, atol=0)
    for index, moments in single.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[index][key], moments[key], rtol=1e-5, atol=1e-7)
    sw.checkpoint.transform(tmp_path / "p", tmp_path / "q_in", plan_b())
    got = first + leg(tmp_path, 2, "q", "--plan", "dp", "--first", "3", "--load-plain",
                      str(tmp_path / "q_in"), "--save", str(tmp_path / "q"))  # fmt: skip
    check_continued(tmp_path, "q", got, want, single)


def state_files(src: Path, n: int, step: int) -> list[set[str]]:
    """The optimizer entries in each of the `n` rank files of `src` at `step`."""
    files = [safetensors.torch.load_file(src / f"rank_{r}" / f"ckpt-1_{step}.safetensors")
             for r in range(n)]  # fmt: skip
    return [{k for k in f if k.startswith("optimizer.")} for f in files]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_data_parallel_hsdp_resumes_on_fewer_ranks(tmp_path: Path) -> None:
    """Bias-free, every parameter owned: 2 weights on 4 ranks, so 2 ranks own nothing and save
    no optimizer tensor; their files still record the job's 4 ranks (without ``rank_3/`` the
    checkpoint is refused). A 2-rank data_parallel + hsdp job loads it, trains 3 steps and saves:
    each weight's state again in its owner's file only (the state loaded whole is dropped on
    the other rank), and one device ends the run like one that never stopped."""
    want, single = uninterrupted(bias=False)
    dp_mode = ("--plan", "dp-mode", "--threshold", "0", "--no-bias")
    first = leg(tmp_path, 4, "r", *dp_mode, "--save", str(tmp_path / "r"))
    held = state_files(tmp_path / "r", 4, 3)
    assert sorted(map(len, held)) == [0, 0, 3, 3]  # (one weight's step, exp_avg, exp_avg_sq)
    shutil.copytree(tmp_path / "r", tmp_path / "short")
    shutil.rmtree(tmp_path / "short" / "rank_3")
    with pytest.raises(sw.checkpoint.CheckpointError, match="of 4 ranks but the files of rank_3"):
        sw.checkpoint.transform(tmp_path / "short", tmp_path / "short_out")
    got = first + leg(tmp_path, 2, "s", *dp_mode, "--first", "3", "--load", str(tmp_path / "r"),
                      "--save", str(tmp_path / "s"))  # fmt: skip
    for name in ("fc1.weight", "fc2.weight"):
        holders = [
            k for k in state_files(tmp_path / "s", 2, 6) if f"optimizer.state.{name}.exp_avg" in k
        ]
        assert len(holders) == 1, name
    check_continued(tmp_path, "s", got, want, single, bias=False)
