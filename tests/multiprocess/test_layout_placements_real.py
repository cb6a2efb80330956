"""`to_placements` on 8 real gloo processes: `distribute_tensor(global, mesh, to_placements(L))`
holds ``global[L.local_slice(rank, shape)]`` on every rank, `_StridedShard` layouts included
(LocalTensorMode cannot be trusted for those, see TESTING.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_job

WORKER = Path(__file__).with_name("layout_placements_worker.py")
EXPECTED = ["CHECK seed003 OK", "CHECK (2, 2, 2) OK 49", "CHECK (2, 4) OK 11", "CHECK (4, 2) OK 11"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_layout_placements_on_eight_real_processes(tmp_path: Path) -> None:
    res = run_job(WORKER, 8, tmp_path / "logs", timeout=200)
    logs = "".join(
        res.worker_log(r) for r in range(8) if (res.log_dir / f"worker_{r}.log").exists()
    )
    assert res.returncode == 0, res.output + logs
    for rank in range(8):
        log = res.worker_log(rank)
        for line in EXPECTED:
            assert line in log, f"rank {rank} did not pass {line!r}:\n{log}"
