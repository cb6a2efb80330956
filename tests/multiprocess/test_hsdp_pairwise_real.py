"""Optimizer parallel on 2 real gloo processes through the pairwise bucket transport (buckets of
>= 256 KiB per rank), levels 1-3, with an unused layer gathered ahead, and plain data parallel's
bucketed asynchronous gradient AllReduce (one 25 MB bucket, and 1 MB buckets started while
backward goes on; one and two backward calls per step, and gradients taken with
torch.autograd.grad), and a backward that raised midway then a clean one at levels 2-3:
losses, gradients and every shard equal single-device training; a graph kept across the next
step's in-place refill of the compute leaves (levels 1-2) is refused by autograd
(hsdp_pairwise_worker.py)."""

from __future__ import annotations

import pytest

from shardwise.testing import JobResult

MODES = ("level1", "level2", "level3", "dp", "dp buckets")
MODES = (*MODES, *(f"{m} accumulate" for m in MODES))  # the worker's MODES


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hsdp_levels_on_two_real_processes(two_rank_job: JobResult) -> None:
    extra = ("dp autograd.grad", "level2 failed backward", "level3 failed backward")
    extra = (*extra, "level1 kept graph refused", "level2 kept graph refused")
    forms = [f"{lv} {f}" for lv in ("level1", "level3") for f in ("module", "step")]
    extra = (*extra, *(f"{form} inference mode" for form in forms))
    two_rank_job.assert_checks(2, (*MODES, *extra))
