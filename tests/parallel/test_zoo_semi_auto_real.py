"""nanoGPT's GPT-2 in semi_auto on 4 real gloo processes started by `shardwise run`
(zoo_semi_auto_worker.py), with no annotation and then with Megatron annotations at 2 x 2
(``sw.shard`` on the ``nn.Linear``s), also evaluated under ``torch.inference_mode()``: per
step the loss, every gradient (block), every parameter and the collectives match (the worker
checks against its own single-device run). The worker's checks run in the tests' one 4-process
job (the ``four_rank_job`` fixture)."""

from __future__ import annotations

import pytest

from shardwise.testing import JobResult


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gpt2_semi_auto_on_four_real_processes(four_rank_job: JobResult) -> None:
    res = four_rank_job
    logs = [res.worker_log(r) for r in range(4)]
    assert res.returncode == 0, res.output + "".join(logs)
    for rank, log in enumerate(logs):
        for step in range(2):
            assert f"CHECK step {step} OK" in log, f"rank {rank}, step {step}:\n{log}"
            assert f"CHECK megatron step {step} OK" in log, f"rank {rank}, megatron {step}:\n{log}"
            assert f"CHECK inference step {step} OK" in log, f"rank {rank}, eval {step}:\n{log}"
            for model in ("gpt2", "encoder"):
                assert f"CHECK dropout {model} step {step} OK" in log, f"rank {rank}:\n{log}"
