"""API.md's train step (seed 003 with nn.Linear, F.relu and nn.CrossEntropyLoss) under
`AutoParallel` on 8 real gloo processes started by `shardwise run`: the returned loss and every
parameter block after each of 3 SGD steps equal the single-device run (train_step_worker.py);
then, in the same processes, seed 003's Layout version (real process groups, each rank creating
its own): losses, parameter and gradient blocks equal the single-device run for 3 SGD steps
(seed003_worker.py); then delayed init: seed 003's initializer network built inside
``sw.no_init_parameters()``, materialized by AutoParallel's first call, checked before the first
step and after each of 3 steps (delayed_init_worker.py). One 8-process job for these and the
other tests that need 8 real ranks (the ``eight_rank_job`` fixture)."""

from __future__ import annotations

import pytest

from shardwise.testing import JobResult


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_train_step_on_eight_real_processes(eight_rank_job: JobResult) -> None:
    res = eight_rank_job
    logs = [res.worker_log(r) for r in range(8)]
    assert res.returncode == 0, res.output + "".join(logs)
    for rank, log in enumerate(logs):
        for step in range(3):
            assert f"CHECK step {step} OK" in log, f"rank {rank}, step {step}:\n{log}"
            assert f"CHECK seed003 step {step} OK" in log, f"rank {rank}, seed 003 {step}:\n{log}"
            assert f"CHECK delayed init step {step} OK" in log, f"rank {rank}, delayed {step}"
        assert "CHECK delayed init step 0 init OK" in log, f"rank {rank}:\n{log}"
