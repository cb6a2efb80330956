"""examples/quick_start.py (seed 002) on 8 real processes, through ``shardwise run`` and through
Open MPI's ``mpirun`` (as the seed's run_with_mpi.sh), checked the same way (`check_job`):

- every rank prints the same 20 loss lines (5 epochs of 4 steps), equal to plain torch training
  of the same network on the same 2 rows (`reference`: the global batch is 8 copies of them), so
  they decrease as one device's do;
- ``saved_graph/rank_<r>/step_parallel_begin.ir`` shows relu ``((2, 4),)`` and matmul2
  ``((2, 4), (4, 1))`` propagated, and ``execute.ir`` the AllReduce over 0-1-2-3 (4-5-6-7 on
  ranks 4-7) and the seed's local ``StridedSlice((0, 0), (8, 4), (1, 1))``; each rank's
  ``plan.html`` marks that rank, and rank 0 alone draws ``plan.png``;
- each rank's last checkpoint holds its block of the weights, equal to the reference's.

Under Open MPI's ``mpirun`` (the seed's run_with_mpi.sh) the same script reads the job from
``OMPI_COMM_WORLD_*``: `test_init_under_mpirun` runs 4 ranks of a script that joins with
``init()`` and all-reduces (the example itself is checked under ``shardwise run``: a second
8-process run of it under mpirun took ~25 s of the suite's budget for the same checks). It is
skipped with the reason when ``mpirun`` is not on PATH (``make test`` installs Open MPI where it
can, see the Makefile's ``mpi`` target).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing import clean_env, free_port, run_job

EXAMPLE = Path(__file__).parents[2] / "examples" / "quick_start.py"
ALLREDUCE = Path(__file__).with_name("workers") / "allreduce.py"
WORLD, EPOCHS, STEPS = 8, 5, 4
LOSS_LINE = re.compile(r"epoch: (\d+) step: (\d+), loss is (\S+)")
MPIRUN = shutil.which("mpirun")


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quick_start", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference() -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """Plain torch on one device: the example's initial weights (``sw.set_seed(1)``, as every
    rank) and its 2 rows, 20 steps of momentum SGD; the losses and the final weights."""
    ex = example()
    sw.set_seed(1)
    net = ex.Net(ex.IN_DIM, ex.HIDDEN_DIM, ex.OUT_DIM)
    w = net.weight.detach().clone().requires_grad_()
    w2 = net.weight2.detach().clone().requires_grad_()
    rows = ex.get_dataset(batch_size=2, in_dim=ex.IN_DIM, out_dim=ex.OUT_DIM, step_per_epoch=1)
    x, y = (torch.from_numpy(a) for a in next(iter(rows())))
    opt = torch.optim.SGD([w, w2], lr=ex.LEARNING_RATE, momentum=ex.MOMENTUM)
    losses = []
    for _ in range(EPOCHS * STEPS):
        loss = F.mse_loss(torch.relu(x @ w) @ w2, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, w.detach(), w2.detach()


def check_job(logs: list[str], root: Path) -> None:
    """The loss lines of every rank, the IR files and the checkpoints under `root`."""
    want, w, w2 = reference()
    for rank, log in enumerate(logs):
        found = LOSS_LINE.findall(log)
        steps = [(int(e), int(s)) for e, s, _ in found]
        assert steps == [(e, s) for e in range(1, 6) for s in range(1, 5)], (rank, log)
        losses = [float(v) for _, _, v in found]
        assert losses == [float(v) for _, _, v in LOSS_LINE.findall(logs[0])], rank
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)
        assert losses[-1] < losses[0] - 0.1, losses

        ir = root / "saved_graph" / f"rank_{rank}"
        begin = (ir / "step_parallel_begin.ir").read_text()
        for op, strategy, rule in [
            ("%0 matmul/MatMul", "((2, 4), (4, 1))", "user"),
            ("%1 relu/ReLU", "((2, 4),)", "propagated"),
            ("%2 matmul2/MatMul", "((2, 4), (4, 1))", "propagated"),
        ]:
            assert f"{op} [shardwise.ops." in begin, begin
            after = begin.split(op, 1)[1].splitlines()[1].strip()
            assert after.startswith(f"in_strategy {strategy} from {rule}; inputs ["), begin
        execute = (ir / "execute.ir").read_text()
        group = [0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7]
        for op in ("matmul", "matmul2"):
            assert f"AllReduce(sum) over g1 at {op}/MatMul group {group} " in execute, execute
        cols = (rank % 4) * 4
        slice_line = (
            f"Slice(dim=1, axis=g1, 4 parts) at relu/ReLU input 0: StridedSlice((0, {cols}), "
            f"(8, {cols + 4}), (1, 1)) of local [8, 16] send_bytes 0"
        )
        assert slice_line in execute, execute
        page = (ir / "plan.html").read_text()  # each process writes its own rank's page
        for i, op in enumerate(["matmul/MatMul", "relu/ReLU", "matmul2/MatMul"]):
            assert f"id='op-{i}'" in page and f"<span class='name'>{op}</span>" in page, page
        assert f"<tr class='me'><td>{rank}</td>" in page
        assert (ir / "plan.png").exists() == (rank == 0), rank  # drawn once, by rank 0

        ckpt = root / "ckpt" / str(rank) / f"rank_{rank}" / "checkpoint-5_4.safetensors"
        saved = sw.load_checkpoint(ckpt)
        k = rank % 4  # weight (32, 16) and weight2 (16, 16): rows split over g1 (4 parts)
        torch.testing.assert_close(saved["weight"], w[8 * k : 8 * k + 8], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(saved["weight2"], w2[4 * k : 4 * k + 4], rtol=1e-4, atol=1e-6)


def example_args(root: Path) -> list[str]:
    return ["--save-graphs-path", str(root / "saved_graph"), "--ckpt-root", str(root / "ckpt")]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_quick_start_eight_processes(tmp_path: Path) -> None:
    started = time.monotonic()
    res = run_job(EXAMPLE, WORLD, tmp_path / "logs", *example_args(tmp_path), timeout=200)
    print(f"shardwise run job: {time.monotonic() - started:.1f} s")
    assert res.returncode == 0, res.output
    logs = [res.worker_log(r) for r in range(WORLD)]
    assert "'relu/ReLU': ((2, 4),)" in logs[0]  # rank 0 prints the strategies
    check_job(logs, tmp_path)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not on PATH: install Open MPI (openmpi-bin)")
def test_init_under_mpirun(tmp_path: Path) -> None:
    assert MPIRUN is not None
    base = clean_env()
    src = str(Path(sw.__file__).parents[1])  # the workers import the shardwise under test
    env = {
        **base,
        "PYTHONPATH": os.pathsep.join(p for p in (src, base.get("PYTHONPATH", "")) if p),
        "MASTER_PORT": str(free_port()),  # the store rank 0 hosts (127.0.0.1: one node)
        "OMP_NUM_THREADS": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",  # Open MPI refuses root otherwise (CI runs as root)
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    cmd = [
        MPIRUN, "-n", "4", "--oversubscribe", "--output-filename", str(tmp_path / "out"),
        sys.executable, str(ALLREDUCE),
    ]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in range(4):  # Open MPI 4 writes OUT/1/rank.<r>/stdout
        (path,) = (tmp_path / "out").glob(f"*/rank.{rank}/stdout")
        assert f"rank {rank} of 4 (local {rank}) sum 6" in path.read_text(), res.stdout
