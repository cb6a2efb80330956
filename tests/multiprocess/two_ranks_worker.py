"""One job of 2 real gloo processes for the tests that need 2 ranks and nothing else of their
own (the ``two_rank_job`` fixture): the checks of unseeded_start_worker.py, gradients_worker.py,
input_convention_worker.py, loss_overlap_worker.py, recompute_worker.py, no_grad_first_worker.py,
hsdp_pairwise_worker.py, model_ranks_worker.py, data_parallel_branch_worker.py,
data_parallel_keep_grads_worker.py and groups_worker.py (last: it leaves the job and joins it
again), one after the other in the same processes, each printing its ``CHECK <name> OK`` lines
(each start of a job costs ~4 s of imports on 2 cores). A check that fails raises: the job
fails and names the rank.
"""

from __future__ import annotations

import data_parallel_branch_worker
import data_parallel_keep_grads_worker
import gradients_worker
import groups_worker
import hsdp_pairwise_worker
import input_convention_worker
import loss_overlap_worker
import model_ranks_worker
import no_grad_first_worker
import recompute_worker
import unseeded_start_worker

import shardwise as sw

if __name__ == "__main__":
    sw.communication.init()
    for worker in (
        unseeded_start_worker,  # (first: before any check seeds torch)
        gradients_worker,
        input_convention_worker,
        loss_overlap_worker,
        recompute_worker,
        no_grad_first_worker,
        hsdp_pairwise_worker,
        model_ranks_worker,
        data_parallel_branch_worker,
        data_parallel_keep_grads_worker,
        groups_worker,  # (last: it leaves the job and joins it again)
    ):
        worker.checks()
    sw.communication.release()
