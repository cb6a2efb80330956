"""examples/optimizer_parallel.py (seed 000: hsdp optimizer parallel) on 4 real processes gives
the same losses as the plain torch network trained on one device on the same global batches
(deterministic synthetic MNIST-shaped data, so the test never skips), at levels 1 and 3."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

import shardwise as sw
from shardwise.testing import run_job

EXAMPLE = Path(__file__).parents[2] / "examples" / "optimizer_parallel.py"
STEPS = 11  # loss lines at steps 0 and 10
ROWS = 32 * STEPS
LINE = re.compile(r"^epoch: (\d+), step: (\d+), loss is (\S+)$", re.M)


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("optimizer_parallel", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_device() -> list[float]:
    """The same network, eager init under the same seed, plain SGD, global batches of 32."""
    ex = example()
    sw.set_seed(1)
    net = ex.Network()
    opt = torch.optim.SGD(net.parameters(), 1e-2)
    losses = []
    for i, (image, label) in enumerate(ex.create_dataset(32, "", ROWS)):
        if i == STEPS:
            break
        loss = torch.nn.functional.cross_entropy(net(image), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_delayed_init_equals_eager_init() -> None:
    ex = example()
    sw.set_seed(1)
    net, _ = ex.build()
    delayed = sw.parameter.materialized_values(net)
    sw.set_seed(1)
    eager = ex.Network()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(delayed[name], p.detach(), rtol=0, atol=0)
    assert [sw.parameter.comm_fusion_of(p) for p in net.parameters()] == [0, 0, 1, 1, 2, 2]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("level", ["level1", "level3"])
def test_optimizer_parallel_example_four_processes(tmp_path: Path, level: str) -> None:
    out = tmp_path / "losses.txt"
    res = run_job(
        EXAMPLE, 4, tmp_path / "logs", "--synthetic", str(ROWS), "--steps", str(STEPS),
        "--level", level, "--losses-out", str(out), timeout=200,
    )  # fmt: skip
    assert res.returncode == 0, res.output
    want = single_device()
    got = [float(x) for x in out.read_text().split()]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    plan = res.worker_log(0)
    assert f"OptimizerPlan hsdp(shard_size=-1, threshold=64 KB, {level})" in plan
    assert "layer1.weight [512, 784] fusion=0: sharded 4-way -> [128, 784]" in plan
    assert "layer2.weight [512, 512] fusion=1: sharded 4-way -> [128, 512]" in plan
    assert "layer3.weight [10, 512] fusion=2: 20480 B < threshold 64 KB" in plan
    for rank in range(4):  # every rank prints the tutorial's lines, with the global loss
        lines = LINE.findall(res.worker_log(rank))
        assert [(int(e), int(s)) for e, s, _ in lines] == [(0, 0), (0, 10)]
        printed = torch.tensor([float(v) for _, _, v in lines])
        torch.testing.assert_close(printed, torch.tensor([want[0], want[10]]), rtol=1e-5, atol=1e-6)
