"""`to_placements` on 8 real gloo processes: `distribute_tensor(global, mesh, to_placements(L))`
holds ``global[L.local_slice(rank, shape)]`` on every rank, `_StridedShard` layouts included
(LocalTensorMode cannot be trusted for those, see TESTING.md); the checks run in the tests' one
8-process job (layout_placements_worker.py, the ``eight_rank_job`` fixture)."""

from __future__ import annotations

import pytest

from shardwise.testing import JobResult

EXPECTED = ["CHECK seed003 OK", "CHECK (2, 2, 2) OK 49", "CHECK (2, 4) OK 11", "CHECK (4, 2) OK 11"]


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_layout_placements_on_eight_real_processes(eight_rank_job: JobResult) -> None:
    res = eight_rank_job
    logs = "".join(
        res.worker_log(r) for r in range(8) if (res.log_dir / f"worker_{r}.log").exists()
    )
    assert res.returncode == 0, res.output + logs
    for rank in range(8):
        log = res.worker_log(rank)
        for line in EXPECTED:
            assert line in log, f"rank {rank} did not pass {line!r}:\n{log}"
