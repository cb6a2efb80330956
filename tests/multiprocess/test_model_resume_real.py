"""`sw.train.resume` continues a tensor-parallel `sw.Model` job from its own `ModelCheckpoint`
files, on 2 real gloo processes (model_resume_worker.py): 1 epoch saved, then 2 more after the
resume, equal to 3 epochs straight. It loaded this rank's file before planning, into the whole
network ("checkpoint shape [4, 6] != network shape [8, 6]"); a rank's file now loads the
checkpoint of all ranks with `sw.checkpoint.load_distributed`. Saved in each rank's own directory
(``ModelCheckpoint(directory=str(rank_id))``, files in ``<r>/rank_<r>/``), the resume looked for
the other rank's file in ``<r>/`` alone and failed on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.testing import run_job

WORKER = Path(__file__).parent / "model_resume_worker.py"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_resume_continues_a_tensor_parallel_model(tmp_path: Path) -> None:
    out = tmp_path / "losses.json"
    res = run_job(WORKER, 2, tmp_path / "logs", str(tmp_path / "ckpt"), str(out), timeout=150)
    logs = "".join(res.worker_log(r) for r in range(2))
    assert res.returncode == 0, res.output + logs
    losses = json.loads(out.read_text())
    straight, first, resumed = losses["straight"], losses["first"], losses["resumed"]
    assert len(straight) == 12 and len(first) == 4 and len(resumed) == 8, losses
    assert first == pytest.approx(straight[:4], rel=1e-6, abs=0)
    assert resumed == pytest.approx(straight[4:], rel=1e-5, abs=0)
    assert losses["seed"] == pytest.approx(straight[4:], rel=1e-5, abs=0)
