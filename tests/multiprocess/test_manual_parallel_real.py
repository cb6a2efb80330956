"""Manual data parallel on 4 real gloo processes (each reading only its rows of every global
batch) equals single-device training on the same global batches: losses and parameters (the
worker's checks run in the tests' one 4-process job, the ``four_rank_job`` fixture)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.testing import JobResult

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from manual_dp_common import GLOBAL_BATCH, make_network, make_samples  # noqa: E402


def single_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    sw.set_seed(5)
    net = make_network()
    data = sw.dataset.GeneratorDataset(make_samples(), ["image", "label"], shuffle=True)
    opt = torch.optim.SGD(net.parameters(), 1e-2, momentum=0.9)
    losses: list[float] = []

    class Record(sw.train.Callback):
        def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
            losses.append(float(ctx.net_outputs))

    sw.Model(net, torch.nn.CrossEntropyLoss(), opt).train(
        2, data.batch(GLOBAL_BATCH), callbacks=[Record()]
    )
    return losses, net.state_dict()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_manual_parallel_four_processes(four_rank_job: JobResult) -> None:
    res = four_rank_job
    assert res.returncode == 0, res.output
    want_losses, want_params = single_device()
    for rank in range(4):
        got = json.loads((res.log_dir.parent / f"rank_{rank}.json").read_text())
        assert len(got["losses"]) == len(want_losses) == 10
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=1e-6
        )
        for name, value in want_params.items():
            torch.testing.assert_close(
                torch.tensor(got["params"][name]), value, rtol=1e-5, atol=1e-6
            )
