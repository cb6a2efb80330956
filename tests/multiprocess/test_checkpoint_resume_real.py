"""Resume equals never stopping, across plans and device counts, on real gloo processes.

Adam on a small MLP: 3 steps on 4 ranks (tensor parallel + optimizer parallel level 1), saved;
the checkpoint transformed to a 2-rank data-parallel plan with optimizer parallel level 3 and
trained 3 more steps; transformed to one device and trained 3 more with plain torch. The 9
losses equal 9 uninterrupted single-device steps, and the final Adam state equals the
single-device one. A second path loads the 4-rank checkpoint straight into the 2-rank job with
`load_distributed` before its first step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
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


def leg(tmp: Path, n: int, tag: str, *args: str) -> list[float]:
    losses = tmp / f"losses_{tag}.txt"
    res = run_job(WORKER, n, tmp / f"logs_{tag}", *args, "--losses-out", str(losses), timeout=150)
    assert res.returncode == 0, res.output
    return [float(v) for v in losses.read_text().split()]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_resume_across_plans_equals_never_stopping(tmp_path: Path) -> None:
    net, opt = build()
    want = train(net, opt, batches(9))
    got = leg(tmp_path, 4, "a", "--plan", "tp", "--save", str(tmp_path / "a"))
    sw.checkpoint.transform(tmp_path / "a", tmp_path / "b_in", plan_b())
    got += leg(tmp_path, 2, "b", "--plan", "dp", "--first", "3", "--load-plain",
               str(tmp_path / "b_in"), "--save", str(tmp_path / "b"))  # fmt: skip
    sw.checkpoint.transform(tmp_path / "b", tmp_path / "c")
    resumed, resumed_opt = build()
    ckpt = sw.load_checkpoint(tmp_path / "c" / "ckpt-1_6.safetensors")
    assert ckpt.step == 6
    assert sw.load_param_into_net(resumed, ckpt, strict_load=True) == ([], [])
    sw.checkpoint.load_optimizer_state(resumed_opt, ckpt, resumed)
    got += train(resumed, resumed_opt, batches(9)[6:])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    final, single = resumed_opt.state_dict()["state"], opt.state_dict()["state"]
    for index, state in single.items():
        assert float(final[index]["step"]) == float(state["step"]) == 9.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(final[index][key], state[key], rtol=1e-5, atol=1e-7)

    direct = leg(tmp_path, 2, "direct", "--plan", "dp", "--first", "3", "--load",
                 str(tmp_path / "a"), "--save", str(tmp_path / "d"))  # fmt: skip
    torch.testing.assert_close(torch.tensor(direct), torch.tensor(want[3:6]), rtol=1e-5, atol=0)
