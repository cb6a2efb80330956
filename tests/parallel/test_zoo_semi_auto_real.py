"""nanoGPT's GPT-2 in semi_auto on 4 real gloo processes started by `shardwise run`
(zoo_semi_auto_worker.py), with no annotation and then with Megatron annotations at 2 x 2
(``sw.shard`` on the ``nn.Linear``s), also evaluated under ``torch.inference_mode()``: per
step the loss, every gradient (block), every parameter and the collectives match (the worker
checks against its own single-device run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_job

WORKER = Path(__file__).parent / "zoo_semi_auto_worker.py"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_gpt2_semi_auto_on_four_real_processes(tmp_path: Path) -> None:
    res = run_job(WORKER, 4, tmp_path / "logs", timeout=150)
    logs = [res.worker_log(r) for r in range(4)]
    assert res.returncode == 0, res.output + "".join(logs)
    for rank, log in enumerate(logs):
        for step in range(2):
            assert f"CHECK step {step} OK" in log, f"rank {rank}, step {step}:\n{log}"
            assert f"CHECK megatron step {step} OK" in log, f"rank {rank}, megatron {step}:\n{log}"
            assert f"CHECK inference step {step} OK" in log, f"rank {rank}, eval {step}:\n{log}"
            for model in ("gpt2", "encoder"):
                assert f"CHECK dropout {model} step {step} OK" in log, f"rank {rank}:\n{log}"
