"""`sw.Model` on 2 real gloo processes (model_ranks_worker.py, in the shared 2-rank job): eval
with the "loss" metric on a dataset sharded over the ranks whose last global batch is short
equals one device's; ModelCheckpoint's ranks agree on one prefix; a cut network saved outside
a rank folder warns."""

from __future__ import annotations

import pytest

from shardwise.testing import JobResult

pytestmark = pytest.mark.multiprocess


def test_model_on_2_processes(two_rank_job: JobResult) -> None:
    two_rank_job.assert_checks(
        2, ["sharded_eval_loss", "checkpoint_prefix_agreed", "shared_path_warning"]
    )
