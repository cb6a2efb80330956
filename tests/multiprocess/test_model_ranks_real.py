"""`sw.Model` on 2 real gloo processes (model_ranks_worker.py, in the shared 2-rank job): eval
with the "loss" metric on a dataset sharded over the ranks whose last global batch is short
equals one device's, also with a loss that all-reduces and through a module-form AutoParallel,
and on a DataLoader over a DistributedSampler;
ModelCheckpoint's ranks agree on one prefix; a cut network saved outside a rank folder warns."""

from __future__ import annotations

import pytest

from shardwise.testing import JobResult

pytestmark = pytest.mark.multiprocess


def test_model_on_2_processes(two_rank_job: JobResult) -> None:
    names = ["sharded_eval_loss", "sharded_eval_same_calls", "distributed_sampler_eval"]
    names.append("checkpoint_prefix_agreed")
    two_rank_job.assert_checks(2, [*names, "shared_path_warning"])
