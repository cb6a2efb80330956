"""`DataParallelRunner` with ``parallel_optimizer=True`` on 4 real gloo processes: the owner-only
update of seed 001's data-parallel optimizer parallel. Every rank's losses and final parameters
equal single-device training; each rank's optimizer state holds exactly the parameters it
updates (its owned ones plus those under the threshold), the non-owned gradients are hidden
from the update and every rank holds every averaged gradient after it, and each step issues 5
AllReduce (4 gradient buckets + the loss) and 2 Broadcast (one per owned (owner, fusion id)
bucket). On 2 real processes (the shared
``two_rank_job``, data_parallel_branch_worker.py): a data-dependent branch that uses a head on
one rank's rows only gets DDP's gradients (the ranks' average, zeros from the rank that did
not use it; None for a head no rank used), with the default buckets, fusion off and optimizer
parallel, as does manual data parallel's ``DistributedGradReducer``; and with optimizer
parallel, gradients kept past a step (no ``zero_grad``) add up as on one device, every rank
holding every parameter's ``.grad`` after each step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from shardwise.testing import JobResult, run_job

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from data_parallel_branch_worker import CASES as BRANCH_CASES  # noqa: E402
from data_parallel_keep_grads_worker import CASES as KEEP_GRADS_CASES  # noqa: E402
from data_parallel_worker import make_data, make_net, make_optimizer  # noqa: E402

NAMES = ["1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
OWNERS = {"1.weight": 0, "3.weight": 1}  # 64 KiB threshold: only the two big weights


def single_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    net, loss_fn = make_net(), torch.nn.CrossEntropyLoss()
    optimizer = make_optimizer(net)
    losses = []
    for x, y in make_data():
        loss = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in net.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_data_parallel_optimizer_parallel_four_processes(tmp_path: Path) -> None:
    res = run_job(
        HERE / "data_parallel_worker.py", 4, tmp_path / "logs", str(tmp_path), timeout=200
    )
    assert res.returncode == 0, res.output
    want_losses, want_params = single_device()
    sizes = {n: p.numel() * p.element_size() for n, p in want_params.items()}
    for rank in range(4):
        got = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=1e-6
        )
        params = torch.load(tmp_path / f"rank_{rank}.pt")
        for name, value in want_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
        assert got["owners"] == OWNERS
        updated = [n for n in NAMES if OWNERS.get(n, rank) == rank]
        assert got["state_params"] == sorted(updated), f"rank {rank}"
        assert got["state_bytes"] == 2 * sum(sizes[n] for n in updated)  # exp_avg, exp_avg_sq
        assert got["hidden_grads"] == [n for n in OWNERS if OWNERS[n] != rank]
        assert got["no_grad_after_step"] == []  # (given back after the update)
        assert got["collectives"] == {"AllReduce": 5, "Broadcast": 2}


@pytest.mark.multiprocess
def test_a_branch_taken_on_one_rank_averages_as_ddp(two_rank_job: JobResult) -> None:
    """Rank 1's rows take an extra head, rank 0's do not (the ranks' flat gradient buffers had
    other sizes and gloo aborted, 'collective mismatch'): both ranks step with one device's
    mean of the ranks' losses (1e-5), the head no rank used keeps ``.grad`` None."""
    two_rank_job.assert_checks(2, [*BRANCH_CASES, "reducer-branch"])


@pytest.mark.multiprocess
def test_complex_parameters_average_as_one_device(two_rank_job: JobResult) -> None:
    """complex64 parameters beside float32 and float64 ones, with and without hsdp: three steps
    on 2 processes match one device (reading the complex bucket's counts raised TypeError)."""
    two_rank_job.assert_checks(2, ["dp-complex", "dp-complex-hsdp"])


@pytest.mark.multiprocess
def test_gradients_kept_past_an_owner_update_add_up_as_on_one_device(
    two_rank_job: JobResult,
) -> None:
    """Two steps without ``zero_grad`` under ``hsdp(threshold=0)`` (each parameter updated by its
    owner only): the second step's gradients add to the first's on every rank (a rank that did
    not own a parameter had ``.grad`` None after the step, so its owner stepped on half the
    first gradient plus the second), and ``.grad`` after each step is one device's on every
    rank; module and train-step forms (1e-5)."""
    two_rank_job.assert_checks(2, KEEP_GRADS_CASES)
